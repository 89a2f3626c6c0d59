"""Chat messages (and tools) -> prompt text through a chat template, with transformers'
`apply_chat_template`, which renders in Jinja's ImmutableSandboxedEnvironment: a template
reaches no Python attribute a sandbox forbids and cannot change the data it is given."""

from __future__ import annotations

from typing import Any

from minisgl.structured.reasoning_parser import THINK_END, THINK_START


def load_tokenizer(model: str) -> Any:
    """The tokenizer of a model directory or hub id (a GGUF file's prepared directory: the
    launcher passes that, models/gguf.py)."""
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


# enable_thinking as a request may set it -> the template variables that say so.
THINKING_SWITCHES: dict[str, dict[str, Any]] = {
    "unset": {},
    "true": {"enable_thinking": True},
    "false": {"enable_thinking": False},
}


def prefilled_think(tokenizer: Any) -> dict[str, bool]:
    """Per THINKING_SWITCHES key: whether the model's own template ends its generation prompt
    inside a think block (Qwen3's Thinking-2507 models: `<think>\\n`), so that the output
    starts in the reasoning and only closes it with `</think>`. False where the template does
    not render a plain user turn (a base model has none)."""
    messages = [{"role": "user", "content": "x"}]
    out = {}
    for key, kwargs in THINKING_SWITCHES.items():
        try:
            with_prompt = render_chat(tokenizer, messages, kwargs, None, True)
            without = render_chat(tokenizer, messages, kwargs, None, False)
        except ValueError:
            out[key] = False
            continue
        prompt = with_prompt.removeprefix(without)
        start = prompt.rfind(THINK_START)
        out[key] = start >= 0 and THINK_END not in prompt[start:]
    return out
