"""The output parsers' tags, and which of them a tokenizer marks special.

Qwen3 leaves `<think>`, `</think>`, `<tool_call>` and `</tool_call>` plain, but some Qwen-family
tokenizers and fine-tunes mark them special, and decoding with skip_special_tokens (the
default) would drop them before the parsers see the text. So a request whose output is parsed
keeps its parsers' tags in the decoded text whatever their flag (every other special token is
still skipped); a tag the parsers leave over is then dropped from the message, as skipping
would have done.
"""

from __future__ import annotations

from typing import Any

from minisgl.structured.reasoning_parser import THINK_END, THINK_START
from minisgl.structured.tool_parser import CALL_END, CALL_START

REASONING_TAGS = (THINK_START, THINK_END)
TOOL_TAGS = (CALL_START, CALL_END)


def _added_special(tokenizer: Any) -> dict[int, str]:
    """id -> text of the tokens that skip_special_tokens drops."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found = {int(i): str(t) for i, t in added.items() if getattr(t, "special", False)}
    for i, text in zip(
        getattr(tokenizer, "all_special_ids", None) or [],
        getattr(tokenizer, "all_special_tokens", None) or [],
        strict=False,
    ):
        found.setdefault(int(i), str(text))
    return found


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    return frozenset(_added_special(tokenizer))


def special_tags(tokenizer: Any) -> list[str]:
    """The parser tags that this tokenizer decodes as special tokens."""
    special = set(_added_special(tokenizer).values())
    return [t for t in REASONING_TAGS + TOOL_TAGS if t in special]
