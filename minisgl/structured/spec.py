"""Which grammar a request asks for, as (kind, value) strings: torch-free, shared by the API
server (which builds them from the OpenAI fields) and the scheduler (which compiles them)."""

from __future__ import annotations

import json
from typing import Any

# kind -> the request field a 400 names when the grammar is invalid.
KIND_FIELDS = {
    "json_schema": "response_format",
    "json_object": "response_format",
    "structural_tag": "response_format",
    "regex": "regex",
    "ebnf": "ebnf",
    "choice": "guided_choice",
}


def choice_ebnf(choices: list[str]) -> str:
    """A grammar matching exactly one of `choices` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# xgrammar (0.2.x) lets a length-bounded JSON string hold raw control characters (a tab, a
# newline), which strict JSON parsers reject; a pattern of the same bounds keeps them out.
_PLAIN_CHARS = '[^"\\\\\\x00-\\x1f]'


def harden_schema(schema: Any) -> Any:
    """A copy of a JSON schema whose length-bounded strings cannot hold raw control chars."""
    if isinstance(schema, list):
        return [harden_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: harden_schema(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and "pattern" not in out and "format" not in out:
        lo, hi = out.get("minLength", 0), out.get("maxLength")
        if isinstance(lo, int) and (hi is None or isinstance(hi, int)):
            out["pattern"] = f"^{_PLAIN_CHARS}{{{lo},{'' if hi is None else hi}}}$"
    return out
