"""Which grammar a request asks for, as (kind, value) strings: torch-free, shared by the API
server (which builds them from the OpenAI fields) and the scheduler (which compiles them)."""

from __future__ import annotations

import json

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
