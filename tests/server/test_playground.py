"""The playground page in a real headless browser, against the live server."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from browser import launch_browser
from harness import ServerProcess

from minisgl.metrics.names import NUM_RUNNING

pytestmark = pytest.mark.timeout(300)
WAIT_MS = 60_000  # generous: a busy 2-core machine runs the server and the browser


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    yield from launch_browser()


@pytest.fixture
def page(browser: Any, server: ServerProcess) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    yield page
    context.close()


def _running(server: ServerProcess) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(NUM_RUNNING + "{") or line.startswith(NUM_RUNNING + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{NUM_RUNNING} is not exposed")


def _wait_running(server: ServerProcess, want: float, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while (got := _running(server)) != want:
        assert time.monotonic() < deadline, f"{NUM_RUNNING} stayed {got}, want {want}"
        time.sleep(0.1)


def _chat_bodies(page: Any) -> list[dict[str, Any]]:
    """The bodies of the chat requests the page sends, in order, as the browser sends them."""
    sent: list[dict[str, Any]] = []
    page.on(
        "request",
        lambda r: sent.append(json.loads(r.post_data)) if "chat/completions" in r.url else None,
    )
    return sent


def _answer_text(page: Any) -> str:
    return page.locator(".message.assistant .text").last.inner_text()


def test_chat_streams_an_answer_and_stop_aborts_it(
    page: Any, server: ServerProcess, tmp_path: Path
) -> None:
    page.goto(f"{server.url}/")
    page.wait_for_function("document.querySelector('#model').options.length > 0")
    page.fill("#max_tokens", "3000")
    page.fill("#input", "Tell me a long story about the moon.")
    page.press("#input", "Enter")
    assert page.locator(".message.user .text").inner_text() == (
        "Tell me a long story about the moon."
    )
    page.wait_for_function(
        "document.querySelector('.message.assistant .text')?.textContent.length > 0"
    )
    first = _answer_text(page)
    _wait_running(server, 1)  # the request runs on the server...
    # ...and the answer keeps growing on the page while it does: it is streamed.
    page.wait_for_function(
        "n => document.querySelector('.message.assistant .text').textContent.length > n",
        arg=len(first),
    )
    page.screenshot(path=str(tmp_path / "streaming.png"))
    page.click("#stop-button")
    page.wait_for_selector(".message.assistant[data-outcome='stopped']")
    _wait_running(server, 0)  # the server aborted it: nothing runs, every page is free
    server.wait_idle()
    stats = page.locator(".message.assistant .stats").inner_text()
    assert "TTFT" in stats and "stopped" in stats, stats
    assert page.locator("#send").is_enabled() and page.locator("#stop-button").is_disabled()
    page.screenshot(path=str(tmp_path / "stopped.png"), full_page=True)
    assert (tmp_path / "stopped.png").stat().st_size > 0


def test_finished_answer_shows_ttft_rate_and_token_counts(
    page: Any, server: ServerProcess, tmp_path: Path
) -> None:
    sent = _chat_bodies(page)
    page.goto(f"{server.url}/playground")
    page.fill("#system", "You are terse.")
    page.uncheck("#thinking")
    for field, value in {"#temperature": "0", "#max_tokens": "8", "#seed": "7"}.items():
        page.fill(field, value)
    page.fill("#stop", "zzz\nyyy")
    page.fill("#input", "hi")
    page.click("#send")
    page.wait_for_selector(".message.assistant[data-outcome='finished: length']")
    stats = page.locator(".message.assistant .stats").inner_text()
    assert "TTFT" in stats and "tokens/s" in stats and "8 completion tokens" in stats, stats
    assert "prompt" in stats, stats  # from the usage chunk (stream_options.include_usage)
    body = sent[0]
    assert body["messages"] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "hi"},
    ]
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0 and body["max_tokens"] == 8 and body["seed"] == 7
    assert body["stop"] == ["zzz", "yyy"] and body["top_k"] == 20
    # The next turn carries the conversation so far.
    page.fill("#input", "again")
    page.click("#send")
    page.wait_for_function(
        "document.querySelectorAll('.message.assistant[data-outcome]').length == 2"
    )
    assert [m["role"] for m in sent[1]["messages"]] == ["system", "user", "assistant", "user"]


def test_stop_strings_are_one_per_line_with_escapes(page: Any, server: ServerProcess) -> None:
    """A comma, a newline or a space can be a stop string (the field split on commas, so ","
    and "\\n" could not be entered): one per line, typed, or with \\n-style escapes."""
    sent = _chat_bodies(page)
    page.goto(f"{server.url}/playground")
    page.uncheck("#thinking")
    page.fill("#max_tokens", "2")
    page.click("#stop")
    page.keyboard.type(",")
    page.keyboard.press("Enter")  # a new line in the field, not a send
    page.keyboard.type("\\n")  # backslash n: a newline
    page.keyboard.press("Enter")
    page.keyboard.type("a, b\\t\\\\n")  # as typed but the escapes: "a, b<tab>\\n"
    page.keyboard.press("Enter")
    page.keyboard.press("Enter")  # an empty line is no stop string
    page.keyboard.type(" ")
    assert sent == []
    page.fill("#input", "hi")
    page.click("#send")
    page.wait_for_selector(".message.assistant[data-outcome]")
    assert sent[0]["stop"] == [",", "\n", "a, b\t\\n", " "]


def test_clear_during_a_stream_starts_an_empty_conversation(
    page: Any, server: ServerProcess
) -> None:
    sent = _chat_bodies(page)
    page.goto(f"{server.url}/")
    page.wait_for_function("document.querySelector('#model').options.length > 0")
    page.uncheck("#thinking")
    page.fill("#max_tokens", "3000")
    page.fill("#input", "Tell me a long story about the sea.")
    page.press("#input", "Enter")
    page.wait_for_function(
        "document.querySelector('.message.assistant .text')?.textContent.length > 0"
    )
    page.click("#clear")  # mid-stream: aborts the answer and empties the conversation
    page.wait_for_selector("#send:enabled")
    _wait_running(server, 0)
    assert page.locator("#messages .message").count() == 0
    page.fill("#max_tokens", "4")
    page.fill("#input", "q2")
    page.click("#send")
    page.wait_for_selector(".message.assistant[data-outcome^='finished']")
    # Before: [assistant: <the aborted answer>, user: q2].
    assert sent[1]["messages"] == [{"role": "user", "content": "q2"}], sent[1]["messages"]


def test_a_failed_request_leaves_no_turn_behind(page: Any, server: ServerProcess) -> None:
    sent = _chat_bodies(page)
    # The first request fails as with a wrong API key: the server's own 401 reply.
    unauthorized = json.dumps(
        {
            "error": {
                "message": "invalid or missing API key (Authorization: Bearer)",
                "type": "authentication_error",
                "param": None,
                "code": None,
            }
        }
    )
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(status=401, content_type="application/json", body=unauthorized),
    )
    page.goto(f"{server.url}/")
    page.wait_for_function("document.querySelector('#model').options.length > 0")
    page.fill("#max_tokens", "4")
    page.fill("#input", "q1")
    page.click("#send")
    page.wait_for_selector(".message.assistant[data-outcome='error']")
    assert "401: invalid or missing API key" in page.inner_text("#error")
    restored = page.input_value("#input")
    page.unroute("**/v1/chat/completions")  # the server answers from now on
    page.fill("#input", "q2")
    page.click("#send")
    page.wait_for_selector(".message.assistant[data-outcome^='finished']")
    # Before: [user: q1, assistant: '', user: q2].
    assert sent[1]["messages"] == [{"role": "user", "content": "q2"}], sent[1]["messages"]
    assert restored == "q1"  # the unanswered question came back into the input to retry
    unsent = page.locator(".message.unsent")  # and stays on the page, marked as not sent
    assert unsent.count() == 2 and unsent.first.inner_text() == "q1"
    page.fill("#input", "q3")
    page.click("#send")
    page.wait_for_function(
        "document.querySelectorAll('.message.assistant[data-outcome^=finished]').length == 2"
    )
    third = [(m["role"], m["content"]) for m in sent[2]["messages"]]
    assert [role for role, _ in third] == ["user", "assistant", "user"], third
    assert third[0] == ("user", "q2") and third[2] == ("user", "q3"), third


def test_raw_completion_mode(page: Any, server: ServerProcess) -> None:
    sent: list[str] = []
    page.on("request", lambda r: sent.append(r.url) if "/v1/" in r.url else None)
    page.goto(f"{server.url}/")
    page.click("#mode-completion")
    assert page.locator("#input").is_hidden() and page.locator("#system").is_hidden()
    page.fill("#max_tokens", "5")
    page.fill("#temperature", "0")
    page.fill("#raw-prompt", "The capital of France is")
    page.click("#send")
    page.wait_for_selector("#raw-output .message[data-outcome='finished: length']")
    assert page.locator("#raw-output .text").inner_text()
    assert "5 completion tokens" in page.locator("#raw-stats").inner_text()
    assert sent[-1].endswith("/v1/completions")


def test_reasoning_is_folded_apart_from_the_answer(page: Any, server: ServerProcess) -> None:
    """Both ways a server may send reasoning: `reasoning_content` deltas (a reasoning parser)
    and raw <think>...</think> in the content."""

    def sse(*deltas: dict[str, str]) -> str:
        chunks = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
        chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"

    replies = iter(
        [
            sse(
                {"reasoning_content": "The user "},
                {"reasoning_content": "greets."},
                {"content": "Hello!"},
            ),
            sse({"content": "<think>\nhmm"}, {"content": "</think>\n\nHi"}, {"content": " there"}),
        ]
    )
    page.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(
            status=200, content_type="text/event-stream", body=next(replies)
        ),
    )
    page.goto(f"{server.url}/")
    for n in (1, 2):
        page.fill("#input", f"hello {n}")
        page.click("#send")
        page.wait_for_function(
            f"document.querySelectorAll('.message.assistant[data-outcome]').length == {n}"
        )
    answers = page.locator(".message.assistant")
    assert answers.nth(0).locator(".text").inner_text() == "Hello!"
    reasoning = answers.nth(0).locator("details.reasoning div").text_content()
    assert reasoning == "The user greets.", reasoning
    assert answers.nth(1).locator(".text").inner_text().strip() == "Hi there"
    assert "hmm" in answers.nth(1).locator("details.reasoning div").text_content()
    assert answers.nth(1).locator("details.reasoning").get_attribute("open") is None  # folded


def test_api_key_is_sent_and_kept_in_the_session_only(page: Any, server: ServerProcess) -> None:
    auth: list[str | None] = []
    page.on(
        "request",
        lambda r: auth.append(r.headers.get("authorization")) if "/v1/" in r.url else None,
    )
    page.goto(f"{server.url}/")
    page.fill("#api-key", "sk-playground")
    page.press("#api-key", "Tab")  # change event: stored, models listed again
    page.wait_for_function("sessionStorage.getItem('minisgl.apiKey') === 'sk-playground'")
    page.fill("#max_tokens", "2")
    page.fill("#input", "hi")
    page.click("#send")
    page.wait_for_selector(".message.assistant[data-outcome]")
    assert auth[0] is None and auth[-1] == "Bearer sk-playground", auth
    assert page.evaluate("localStorage.length") == 0
    page.reload()  # same tab: still there
    assert page.input_value("#api-key") == "sk-playground"


def test_page_works_behind_an_ingress_path_prefix(browser: Any, server: ServerProcess) -> None:
    """An Ingress serving the API under /team/llm/ (prefix stripped): every URL the page uses
    must resolve under the prefix, whether it is opened with or without the trailing slash."""
    prefix = "http://ingress.test/team/llm"
    outside: list[str] = []

    def proxy(route: Any) -> None:
        url = route.request.url
        if not url.startswith(prefix + "/") and url != prefix:
            outside.append(url)
            route.fulfill(status=404, body="outside the prefix")
            return
        target = server.url + (url[len(prefix) :] or "/")
        route.fulfill(response=route.fetch(url=target))

    for opened in (prefix, prefix + "/", prefix + "/playground"):
        context = browser.new_context()
        context.route("http://ingress.test/**", proxy)
        page = context.new_page()
        page.set_default_timeout(WAIT_MS)
        page.goto(opened)
        page.wait_for_function("document.querySelector('#model').options.length > 0")
        color = page.eval_on_selector("header", "e => getComputedStyle(e).backgroundColor")
        assert color == "rgb(255, 255, 255)", color  # the stylesheet loaded
        context.close()
    assert not outside, outside
