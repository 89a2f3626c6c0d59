"""Chat messages (and tools) -> prompt text through a chat template, with transformers'
`apply_chat_template`, which renders in Jinja's ImmutableSandboxedEnvironment: a template
reaches no Python attribute a sandbox forbids and cannot change the data it is given."""

from __future__ import annotations

from typing import Any


def load_tokenizer(model: str) -> Any:
    from transformers import AutoTokenizer  # heavy import: only in the workers

    return AutoTokenizer.from_pretrained(model)


def render_chat(
    tokenizer: Any,
    messages: Any,
    template_kwargs: Any,
    tools: Any,
    add_generation_prompt: bool,
) -> str:
    """The rendered prompt. Raises ValueError with a user-facing message: jinja errors (a
    sandbox violation included) and bad kwargs are the request's fault."""
    kwargs = dict(template_kwargs)
    if tools:
        kwargs["tools"] = tools
    try:
        return str(
            tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        )
    except Exception as exc:
        raise ValueError(f"cannot apply the chat template: {exc}") from exc
