"""OpenAI request fields -> what the engine enforces: the grammar of a structured output
(response_format, SGLang's regex/ebnf, vLLM's guided_*) or of a forced tool call, and the
tools the chat template renders. Conflicts and unusable values are 400s naming the field."""

from __future__ import annotations

import json
from typing import Any

from minisgl.server.errors import APIError
from minisgl.server.protocol import ChatCompletionRequest, NamedToolChoice, SamplingFields
from minisgl.structured.tool_grammar import tool_call_grammar

Grammar = tuple[str, str]  # (kind, value): see minisgl.structured.spec


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise APIError(400, f"{param} is not valid JSON", param) from None
    if not isinstance(schema, dict | bool):
        raise APIError(400, f"{param} must be a JSON schema object", param)
    return json.dumps(schema, ensure_ascii=False)


def _response_format(req: SamplingFields) -> Grammar | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return "json_object", ""
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(
                400,
                "response_format.json_schema.schema is required for type json_schema",
                "response_format",
            )
        return "json_schema", _schema_text(fmt.json_schema.schema_, "response_format")
    if fmt.format is None:
        raise APIError(
            400, "response_format.format is required for type structural_tag", "response_format"
        )
    tag = {"type": "structural_tag", "format": fmt.format}
    return "structural_tag", json.dumps(tag, ensure_ascii=False)


def output_grammar(req: SamplingFields) -> Grammar | None:
    """The structured-output grammar a request asks for (at most one of the spellings)."""
    found: list[tuple[str, Grammar]] = []
    rf = _response_format(req)
    if rf is not None:
        found.append(("response_format", rf))
    if req.guided_json is not None:
        found.append(("guided_json", ("json_schema", _schema_text(req.guided_json, "guided_json"))))
    for field, kind in (
        ("regex", "regex"),
        ("guided_regex", "regex"),
        ("ebnf", "ebnf"),
        ("guided_grammar", "ebnf"),
    ):
        value = getattr(req, field)
        if value is not None:
            if not value:
                raise APIError(400, f"{field} must not be empty", field)
            found.append((field, (kind, value)))
    if req.guided_choice is not None:
        if any(not c for c in req.guided_choice):
            raise APIError(400, "guided_choice entries must be non-empty", "guided_choice")
        found.append(("guided_choice", ("choice", json.dumps(req.guided_choice))))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise APIError(400, f"ask for one structured output at a time, not {names}", found[1][0])
    return found[0][1] if found else None


def grammar_field(req: SamplingFields) -> str | None:
    """The request field that gave its grammar (chat_grammar / output_grammar found at most
    one): the scheduler's 400 for a grammar it cannot compile names this field."""
    if isinstance(req, ChatCompletionRequest) and req.tool_choice not in (None, "auto", "none"):
        return "tools"  # the forced call's grammar holds the tools' parameter schemas
    if req.response_format is not None and req.response_format.type != "text":
        return "response_format"
    spellings = ("guided_json", "regex", "guided_regex", "ebnf", "guided_grammar", "guided_choice")
    return next((f for f in spellings if getattr(req, f) is not None), None)


def template_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools the chat template renders (none for tool_choice none, as SGLang does)."""
    if not req.tools or req.tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


def forced_tool_grammar(req: ChatCompletionRequest) -> Grammar | None:
    """For tool_choice required or a named function: the grammar that forces the call(s)."""
    choice = req.tool_choice
    if choice in (None, "auto", "none"):
        return None
    if not req.tools:
        raise APIError(400, "tool_choice needs tools", "tool_choice")
    functions = [(t.function.name, t.function.parameters) for t in req.tools]
    parallel = req.parallel_tool_calls
    if isinstance(choice, NamedToolChoice):
        named = [f for f in functions if f[0] == choice.function.name]
        if not named:
            raise APIError(
                400,
                f"tool_choice names function {choice.function.name!r}, which is not in tools",
                "tool_choice",
            )
        functions, parallel = named, False
    return "structural_tag", tool_call_grammar(functions, parallel)


def chat_grammar(req: ChatCompletionRequest) -> Grammar | None:
    tools = forced_tool_grammar(req)
    out = output_grammar(req)
    if tools is not None and out is not None:
        raise APIError(
            400,
            "tool_choice required or named cannot be combined with a structured output",
            "tool_choice",
        )
    return tools or out


def validate_tools(req: ChatCompletionRequest) -> None:
    names = [t.function.name for t in req.tools or []]
    if len(set(names)) != len(names):
        raise APIError(400, "tools must have distinct function names", "tools")
