"""The detokenizer keeps the parsers' tags of a request that asks for them, even where the
tokenizer marks them special, and still skips every other special token."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from minisgl.message.scheduler_to_detokenizer import RequestRegistered, TokenBatch, TokenOutput
from minisgl.structured.tags import special_tags
from minisgl.testing.tokenizer_builder import PARSER_TAGS, mark_special
from minisgl.tokenizer.detokenizer_worker import Detokenizer

TEXT = "<think>hm</think><|im_start|>ok<tool_call>{}</tool_call>"


@pytest.fixture(scope="module")
def special_tokenizer(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("special-tags-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, out / name)
    mark_special(out, PARSER_TAGS)
    return AutoTokenizer.from_pretrained(out)


def _decode(tokenizer: Any, keep: list[str]) -> str:
    detok = Detokenizer(tokenizer)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok.handle(RequestRegistered("r", [], [], True, 1, keep_special=keep))
    (batch,), _ = detok.handle(TokenBatch([TokenOutput("r", ids, True, "length", 1, 0, 1)]))
    return "".join(o.text for o in batch.outputs)


def test_kept_tags_survive_skipping(special_tokenizer: Any, hf_tokenizer: Any) -> None:
    assert special_tags(special_tokenizer) == ["<think>", "</think>", "<tool_call>", "</tool_call>"]
    assert special_tags(hf_tokenizer) == []  # Qwen3's own: the tags are plain
    kept = "<think>hm</think>ok<tool_call>{}</tool_call>"
    assert _decode(special_tokenizer, list(PARSER_TAGS)) == kept
    assert _decode(special_tokenizer, ["<think>", "</think>"]) == "<think>hm</think>ok{}"
    assert _decode(special_tokenizer, []) == "hmok{}"  # skip_special_tokens as before
    assert _decode(hf_tokenizer, list(PARSER_TAGS)) == kept
    assert _decode(hf_tokenizer, []) == kept
