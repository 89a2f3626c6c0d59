"""A chat request -> what the chat template renders: the messages, the template's kwargs,
whether the prompt ends with a new assistant header, and the tools. One path for
/v1/chat/completions, /tokenize and the offline `LLM.chat`, so that all three render the same
prompt. Problems are APIErrors (400s naming the field)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minisgl.server.errors import APIError
from minisgl.server.protocol import ChatCompletionRequest, TokenizeBody
from minisgl.server.structured_request import template_tools, validate_tools
from minisgl.structured.template_kwargs import template_kwargs_problem


@dataclass
class ChatPrompt:
    messages: list[dict[str, Any]]
    template_kwargs: dict[str, Any]
    add_generation_prompt: bool
    tools: list[dict[str, Any]] | None


def chat_prompt(req: ChatCompletionRequest, *, trusted: bool) -> ChatPrompt:
    """The template's inputs of a chat completion request. `trusted`: whether a request may
    bring its own template (--trust-request-chat-template)."""
    validate_tools(req)
    kwargs = template_kwargs(req, trusted=trusted)
    return ChatPrompt(
        messages=[m.template_dict() for m in req.messages],
        template_kwargs=kwargs,
        add_generation_prompt=generation_prompt(req, kwargs),
        tools=template_tools(req),
    )


def template_kwargs(body: ChatCompletionRequest | TokenizeBody, *, trusted: bool) -> dict[str, Any]:
    """The request's chat template kwargs, once it may pass them (a 400 otherwise)."""
    problem = template_kwargs_problem(body.chat_template_kwargs, trusted=trusted)
    if problem is None and body.chat_template is not None:
        problem = template_kwargs_problem(
            {"chat_template": body.chat_template}, trusted=trusted, field=""
        )
    if problem is not None:
        raise APIError(400, *problem)
    return body.template_kwargs()


def generation_prompt(body: ChatCompletionRequest | TokenizeBody, kwargs: dict[str, Any]) -> bool:
    """Whether the prompt ends with a new assistant turn's header. continue_final_message
    (top level, as vLLM takes it, or among the template kwargs, where transformers reads it)
    goes on from the last message instead: it needs that message to be the assistant's and
    rules the header out (unless asked for, add_generation_prompt is then false)."""
    continuing = body.continue_final_message or kwargs.get("continue_final_message") is True
    if not continuing:
        return body.add_generation_prompt
    if "add_generation_prompt" in body.model_fields_set and body.add_generation_prompt:
        raise APIError(
            400,
            "continue_final_message and add_generation_prompt cannot both be true",
            "continue_final_message",
        )
    messages = body.messages or []
    if not messages or messages[-1].role != "assistant":
        raise APIError(
            400, "continue_final_message needs the last message to be the assistant's", "messages"
        )
    kwargs["continue_final_message"] = True
    return False
