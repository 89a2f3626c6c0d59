"""Request-supplied chat templates: which kwargs may reach the renderer, and the sandbox process
that renders a trusted request's template under a time bound."""

from __future__ import annotations

import inspect
import time
from pathlib import Path

import pytest

from minisgl.structured.template_kwargs import RENDERER_PARAMS, template_kwargs_problem
from minisgl.tokenizer.template_sandbox import RenderError, RenderJob, TemplateSandbox

MSG = [{"role": "user", "content": "hi"}]
# Legal Jinja, sandbox or not: 10^10 loop turns.
# The render bound under test (not a wait: the hygiene check's deadlines are for waits).
RENDER_BOUND_S = 1.0
ENDLESS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


def test_a_template_in_the_kwargs_is_refused_unless_trusted() -> None:
    problem = template_kwargs_problem({"chat_template": "{{ 1 }}"}, trusted=False)
    assert problem is not None
    message, param = problem
    assert param == "chat_template_kwargs.chat_template"
    assert "--trust-request-chat-template" in message
    assert template_kwargs_problem({"chat_template": "{{ 1 }}"}, trusted=True) is None
    top = template_kwargs_problem({"chat_template": "x"}, trusted=False, field="")
    assert top is not None and top[1] == "chat_template"
    assert template_kwargs_problem({"enable_thinking": False}, trusted=False) is None


@pytest.mark.parametrize("key", ["tokenize", "return_dict", "tokenizer_kwargs", "tools"])
def test_renderer_parameters_are_never_template_variables(key: str) -> None:
    for trusted in (False, True):
        problem = template_kwargs_problem({key: True}, trusted=trusted)
        assert problem is not None and problem[1] == f"chat_template_kwargs.{key}"


def test_every_renderer_parameter_of_transformers_is_known() -> None:
    """A transformers upgrade that adds a parameter to apply_chat_template must be looked at:
    it could be one more way to hand the renderer something other than a variable."""
    from transformers import PreTrainedTokenizerBase

    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    named = {n for n, p in params.items() if n != "self" and p.kind is not p.VAR_KEYWORD}
    template_inputs = {"documents", "continue_final_message", "chat_template"}
    assert named - template_inputs <= RENDERER_PARAMS, named - template_inputs - RENDERER_PARAMS


def _wait(sandbox: TemplateSandbox, key: str, within: float) -> str | RenderError:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        for got, result in sandbox.poll():
            assert got == key
            return result
        time.sleep(0.01)
    raise AssertionError(f"no result for {key} in {within} s")


def _job(key: str, template: str) -> RenderJob:
    return RenderJob(key, MSG, {"chat_template": template}, None, True)


def test_sandbox_bounds_a_render_and_keeps_rendering(tiny_model_dir: Path) -> None:
    sandbox = TemplateSandbox(str(tiny_model_dir), timeout_s=RENDER_BOUND_S)
    try:
        sandbox.submit(_job("warm", "{{ messages[0].content }}!"))
        assert _wait(sandbox, "warm", 300) == "hi!"  # the first waits for the tokenizer load
        sandbox.submit(_job("slow", ENDLESS))
        sandbox.submit(_job("next", "<{{ messages[0].content }}>"))
        start = time.monotonic()
        slow = _wait(sandbox, "slow", 30)
        assert isinstance(slow, RenderError) and "longer than 1 s" in str(slow)
        assert time.monotonic() - start < 5  # the bound, not the loop's hours
        assert _wait(sandbox, "next", 300) == "<hi>"  # a fresh child took over
    finally:
        sandbox.close()


def test_sandbox_refuses_python_internals(tiny_model_dir: Path) -> None:
    """transformers renders in Jinja's ImmutableSandboxedEnvironment: no way out to Python."""
    sandbox = TemplateSandbox(str(tiny_model_dir), timeout_s=30.0)
    try:
        escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
        sandbox.submit(_job("escape", escape))
        result = _wait(sandbox, "escape", 300)
        assert isinstance(result, RenderError) and "unsafe" in str(result).lower()
        sandbox.submit(_job("mutate", "{{ messages.append(1) }}{{ messages | length }}"))
        result = _wait(sandbox, "mutate", 60)
        assert isinstance(result, RenderError)
    finally:
        sandbox.close()


def test_an_abandoned_render_is_never_reported(tiny_model_dir: Path) -> None:
    sandbox = TemplateSandbox(str(tiny_model_dir), timeout_s=RENDER_BOUND_S)
    try:
        sandbox.submit(_job("queued", "x"))
        assert sandbox.cancel("queued") and not sandbox.cancel("unknown")
        sandbox.submit(_job("warm", "ok"))
        assert _wait(sandbox, "warm", 300) == "ok"
        sandbox.submit(_job("gone", ENDLESS))
        assert sandbox.poll() == [] and sandbox.busy  # now rendering
        assert sandbox.cancel("gone")
        sandbox.submit(_job("kept", "{{ messages[0].content }}"))
        assert _wait(sandbox, "kept", 300) == "hi"  # and never a word about "gone"
        assert not sandbox.busy
    finally:
        sandbox.close()
