"""Reading a model's chat template, to pick the output parsers that fit it (torch-free)."""

from __future__ import annotations

import json
from pathlib import Path

from minisgl.structured.reasoning_parser import THINK_END
from minisgl.structured.tool_parser import CALL_START


def read_chat_template(model_dir: str | Path) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's chat_template (None when neither)."""
    root = Path(model_dir)
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = root / "tokenizer_config.json"
    if not config.is_file():
        return None
    template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def resolve_parser(flag: str, template: str | None, marker: str) -> bool:
    """Whether a parser is on: "auto" turns it on when the template knows the marker."""
    if flag == "auto":
        return bool(template) and marker in template  # type: ignore[operator]
    return flag != "none"


def reasoning_on(flag: str, template: str | None) -> bool:
    """Qwen3's thinking template writes `</think>` and takes `enable_thinking`."""
    if flag == "auto":
        return bool(template) and THINK_END in template and "enable_thinking" in template  # type: ignore[operator]
    return flag != "none"


def tool_calls_on(flag: str, template: str | None) -> bool:
    return resolve_parser(flag, template, CALL_START)
