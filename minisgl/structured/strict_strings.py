"""JSON grammars whose length-bounded strings hold no raw control characters, at xgrammar's own
compile cost (scheduler side: imports xgrammar).

xgrammar (0.2.x) writes a string with minLength/maxLength as `chars{lo, hi}` over the class
`[^"\\\r\n]`, which lets a raw tab or NUL through: strict JSON parsers reject that. Saying the
same through a `pattern` instead went through xgrammar's regex path, whose compile cost is
erratic and huge (64.6 s for maxLength 5000; 13.8 s for 100), so one small request could hold
a compile worker for a minute. Here the schema becomes xgrammar's own EBNF and only that
character class is narrowed: the repetition stays a counted range, compiled in milliseconds.
"""

from __future__ import annotations

import json
import re
from typing import Any

# xgrammar's rule for the characters of a length-bounded string, and the strict one.
_LOOSE_RULE = re.compile(r'^(\w+_characters) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
_STRICT_CLASS = r"(([^\0-\x1f\"\\]))"


def json_schema_ebnf(
    schema: Any,
    *,
    any_whitespace: bool,
    max_whitespace_cnt: int | None = None,
    any_order: bool = False,
) -> str:
    """The EBNF of `schema` (a JSON text or value), bounded strings made strict."""
    import xgrammar as xgr

    text = schema if isinstance(schema, str) else json.dumps(schema)
    grammar = xgr.Grammar.from_json_schema(
        text,
        any_whitespace=any_whitespace,
        max_whitespace_cnt=max_whitespace_cnt,
        any_order=any_order,
    )
    return _LOOSE_RULE.sub(lambda m: f"{m.group(1)} ::= {_STRICT_CLASS}", str(grammar))


def strict_structural_tag(tag: Any) -> Any:
    """A structural tag whose plain JSON-schema contents are their strict EBNF (same whitespace
    rules: a content's schema allows any whitespace, up to its max_whitespace_cnt)."""
    if isinstance(tag, list):
        return [strict_structural_tag(t) for t in tag]
    if not isinstance(tag, dict):
        return tag
    if (
        tag.get("type") == "json_schema"
        and tag.get("style", "json") == "json"
        and not tag.get("excludes")
        and "json_schema" in tag
    ):
        return {
            "type": "grammar",
            "grammar": json_schema_ebnf(
                tag["json_schema"],
                any_whitespace=True,
                max_whitespace_cnt=tag.get("max_whitespace_cnt"),
                any_order=bool(tag.get("any_order", False)),
            ),
        }
    # A schema is data, not a tag: only tags are walked.
    return {k: v if k == "json_schema" else strict_structural_tag(v) for k, v in tag.items()}
