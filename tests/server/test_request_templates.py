"""Chat templates a request brings, against live servers: refused by default (vLLM's
CVE-2025-61620 class), rendered in a sandbox under a time bound when the server trusts them,
and a tokenizer worker that stops answering fails /health."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import COMMON_FLAGS
from harness import ServerProcess

MSG = [{"role": "user", "content": "hi"}]
# Legal Jinja, sandbox or not: 10^10 loop turns (hours).
ENDLESS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
RENDER_BOUND_S = 1.0
HEALTH_TIMEOUT_S = 3.0


def _chat(srv: ServerProcess, timeout: float = 60.0, **extra: Any) -> httpx.Response:
    body = {"model": "m", "messages": MSG, "max_tokens": 4, **extra}
    return httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=timeout)


def test_a_template_in_the_request_is_refused(server: ServerProcess) -> None:
    hostile = {"chat_template": ENDLESS}
    r = _chat(server, timeout=30, chat_template_kwargs=hostile)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "chat_template_kwargs.chat_template"
    assert "--trust-request-chat-template" in err["message"]
    r = _chat(server, timeout=30, chat_template=ENDLESS)  # vLLM's top-level field
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    tok = {"messages": MSG, "chat_template_kwargs": hostile}
    r = httpx.post(f"{server.url}/tokenize", json=tok, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"].endswith("chat_template")
    r = _chat(server, timeout=30, chat_template_kwargs={"tokenize": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs.tokenize"
    start = time.monotonic()
    r = _chat(server, timeout=30)
    assert r.status_code == 200, r.text
    assert time.monotonic() - start < 15  # served now, not after a pinned worker
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200


@pytest.fixture(scope="module")
def trusting(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("trusting") / "server.log"
    srv = ServerProcess(
        tiny_model_dir,
        log,
        *COMMON_FLAGS,
        "--trust-request-chat-template",
        "--chat-template-timeout", str(RENDER_BOUND_S),
        "--tokenizer-health-timeout", str(HEALTH_TIMEOUT_S),
    ).wait_ready()  # fmt: skip
    yield srv
    srv.stop()


def _tokens(srv: ServerProcess, **body: Any) -> list[int]:
    r = httpx.post(f"{srv.url}/tokenize", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def test_a_trusted_template_renders_and_a_slow_one_fails_alone(trusting: ServerProcess) -> None:
    # The request's own template is the one rendered (the first also waits for the sandbox).
    mine = _tokens(
        trusting,
        messages=MSG,
        chat_template="{{ messages[0]['content'] }}!!",
        add_special_tokens=False,
    )
    assert mine == _tokens(trusting, prompt="hi!!", add_special_tokens=False)
    assert _chat(trusting, chat_template_kwargs={"chat_template": "{{ messages[0].content }}"})

    # A slow template next to a normal stream: it fails within the bound, the stream goes on.
    streamed: dict[str, Any] = {}

    def stream() -> None:
        body = {"model": "m", "messages": MSG, "max_tokens": 64, "ignore_eos": True}
        body["stream"] = True
        with httpx.stream(
            "POST", f"{trusting.url}/v1/chat/completions", json=body, timeout=120
        ) as r:
            streamed["status"] = r.status_code
            streamed["done"] = any(line == "data: [DONE]" for line in r.iter_lines())

    other = threading.Thread(target=stream)
    other.start()
    start = time.monotonic()
    r = _chat(trusting, timeout=60, chat_template_kwargs={"chat_template": ENDLESS})
    took = time.monotonic() - start
    assert r.status_code == 400, r.text
    assert "longer than" in r.json()["error"]["message"]
    assert took < RENDER_BOUND_S + 10, took  # the bound (and a busy machine), not hours
    assert httpx.get(f"{trusting.url}/health", timeout=5).status_code == 200
    other.join(120)
    assert streamed == {"status": 200, "done": True}
    start = time.monotonic()
    assert _chat(trusting, timeout=60).status_code == 200
    assert time.monotonic() - start < 15
    # The sandbox was replaced: request templates render again.
    again = _tokens(
        trusting,
        messages=MSG,
        chat_template="{{ messages[0]['content'] }}!!",
        add_special_tokens=False,
    )
    assert again == mine


def test_a_tokenizer_that_stops_answering_fails_health(trusting: ServerProcess) -> None:
    pid = trusting.stats()["workers"]["tokenizer"]
    assert httpx.get(f"{trusting.url}/health", timeout=5).status_code == 200
    os.kill(pid, signal.SIGSTOP)  # alive, but its loop no longer turns
    try:
        deadline = time.monotonic() + HEALTH_TIMEOUT_S + 15
        status = 200
        while time.monotonic() < deadline and status == 200:
            time.sleep(0.2)
            status = httpx.get(f"{trusting.url}/health", timeout=5).status_code
        assert status == 503
        body = httpx.get(f"{trusting.url}/health", timeout=5).json()
        assert "tokenizer" in body["error"]["message"]
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and status != 200:
        time.sleep(0.2)
        status = httpx.get(f"{trusting.url}/health", timeout=5).status_code
    assert status == 200
    assert _chat(trusting).status_code == 200
