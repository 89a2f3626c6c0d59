"""The grammar that makes a Qwen3 model call tools (tool_choice `required` or a named
function): one or more `<tool_call>` blocks exactly as Qwen3's template renders them, each
holding the name of an offered function and arguments that follow its parameter schema.

Built as an xgrammar structural tag (plain JSON, so the API server needs no xgrammar): the
scheduler compiles it like any other grammar.
"""

from __future__ import annotations

import json
from typing import Any

from minisgl.structured.tool_parser import CALL_END, CALL_START

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _tag(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    # The opening and closing text is what Qwen3's template writes around a call's arguments.
    return {
        "type": "tag",
        "begin": CALL_START + "\n" + '{"name": ' + json.dumps(name) + ', "arguments": ',
        "content": {
            "type": "json_schema",
            "json_schema": parameters or ANY_OBJECT,
            # One space where Qwen3 writes one; unbounded whitespace lets a weak model ramble.
            "max_whitespace_cnt": 1,
        },
        "end": "}\n" + CALL_END,
    }


def tool_call_grammar(functions: list[tuple[str, dict[str, Any] | None]], parallel: bool) -> str:
    """Structural tag JSON for at least one call of one of `functions` (name, parameters);
    with `parallel`, more calls may follow, one per line."""
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tags_with_separator",
            "tags": [_tag(name, params) for name, params in functions],
            "separator": "\n",
            "at_least_one": True,
            "stop_after_first": not parallel,
        },
    }
    return json.dumps(tag, ensure_ascii=False)
