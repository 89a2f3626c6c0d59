"""What a request may hand the chat template (`chat_template_kwargs`, torch-free).

The kwargs are meant as template variables (`enable_thinking`). transformers'
`apply_chat_template` also takes its own parameters through the same `**kwargs` door, and one of
them, `chat_template`, replaces the model's template with the caller's Jinja: code a stranger
would run in the tokenizer worker (vLLM's CVE-2025-61620). So a request may only carry a
template when the server runs with `--trust-request-chat-template`, and never the renderer's
other parameters (they change what the call returns, not what the template sees).
"""

from __future__ import annotations

from typing import Any

TEMPLATE_PARAM = "chat_template"

# apply_chat_template's named parameters that are the renderer's, not the template's
# (a unit test checks this against the installed transformers). `documents` and
# `continue_final_message` stay allowed: the template reads them like any variable.
RENDERER_PARAMS = frozenset(
    {
        "conversation",
        "tools",  # the request's `tools` field, validated, is the way in
        "add_generation_prompt",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def template_kwargs_problem(
    kwargs: dict[str, Any], *, trusted: bool, field: str = "chat_template_kwargs"
) -> tuple[str, str] | None:
    """(message, param) of a 400 when `kwargs` may not reach the renderer, else None. `field`:
    where the kwargs came from ("" for the request's top level)."""

    def name(key: str) -> str:
        return f"{field}.{key}" if field else key

    if TEMPLATE_PARAM in kwargs:
        if not trusted:
            return (
                f"{name(TEMPLATE_PARAM)} is refused: this server renders only the model's own "
                "chat template (start it with --trust-request-chat-template to allow request "
                "templates)",
                name(TEMPLATE_PARAM),
            )
        if not isinstance(kwargs[TEMPLATE_PARAM], str):
            return f"{name(TEMPLATE_PARAM)} must be a string", name(TEMPLATE_PARAM)
    bad = sorted(k for k in kwargs if k in RENDERER_PARAMS)
    if bad:
        return (
            f"{name(bad[0])} is a parameter of the template renderer, not a template variable",
            name(bad[0]),
        )
    return None


def request_template(kwargs: dict[str, Any]) -> str | None:
    """The template a (trusted) request brings, if any: it renders in the sandbox process."""
    template = kwargs.get(TEMPLATE_PARAM)
    return template if isinstance(template, str) else None
