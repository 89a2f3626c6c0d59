"""Schemathesis against the live server's own /openapi.json, and security basics.

One server for the module: an API key (also on /metrics), a small body limit and a short
context, so fuzzed requests are cheap and the limits are reachable.
"""

from __future__ import annotations

import collections
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from fastapi.testclient import TestClient
from hardening_support import assert_worker_kill_is_fatal, start_servers, wait_clean
from harness import ServerProcess
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

KEY = "sk-hardening"
BODY_LIMIT = 64 * 1024
CONTEXT = 32
CASES = int(os.environ.get("HARDENING_SCHEMA_CASES", "80"))  # per generation mode
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    flags = ("--api-key", KEY, "--metrics-require-api-key",
             "--max-request-body-bytes", str(BODY_LIMIT), "--max-seq-len-override", str(CONTEXT),
             "--num-pages", "256", "--max-running-requests", "16")  # fmt: skip
    s = start_servers(tiny_model_dir, tmp_path_factory.mktemp("fuzz"), {"fuzz": flags})["fuzz"]
    yield s
    s.stop()


def _no_trace(r: httpx.Response | Any) -> None:
    text = r.text
    for marker in ("Traceback", 'File "', "site-packages", "minisgl/"):
        assert marker not in text, f"{r.status_code} body leaks internals: {text[:300]}"


def _openai_error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    _no_trace(r)
    return body["error"]


def test_openapi_describes_the_real_request_models(srv: ServerProcess) -> None:
    doc = httpx.get(f"{srv.url}/openapi.json", headers=srv.headers).json()
    for path, model in (("/v1/chat/completions", "ChatCompletionRequest"),
                        ("/v1/completions", "CompletionRequest")):  # fmt: skip
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"].endswith(f"/{model}")
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert {"messages", "max_tokens", "stream", "stop", "chat_template_kwargs"} <= set(
        chat["properties"]
    )
    assert "messages" in chat["required"]


def test_schemathesis_finds_no_5xx_and_no_crash(srv: ServerProcess) -> None:
    doc = httpx.get(f"{srv.url}/openapi.json", headers=srv.headers).json()
    schema = schemathesis.openapi.from_dict(doc)
    statuses: collections.Counter[int] = collections.Counter()
    session = httpx.Client(timeout=60)

    def check(case: Any) -> None:
        r = case.call(base_url=srv.url, headers=srv.headers, timeout=60)
        statuses[r.status_code] += 1
        assert r.status_code < 500, f"{case.method} {case.path} {case.body!r} -> {r.text[:300]}"
        if r.status_code >= 400:
            assert "error" in r.json(), r.text
            _no_trace(r)

    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        run = settings(
            max_examples=CASES,
            deadline=None,
            database=None,
            phases=[Phase.generate, Phase.shrink],
            suppress_health_check=list(HealthCheck),
        )(given(case=schema.as_strategy(generation_mode=mode))(check))
        run()
    session.close()
    print(f"schemathesis: {sum(statuses.values())} cases, statuses {dict(statuses)}")
    assert sum(statuses.values()) >= CASES  # the strategy really produced requests
    assert statuses[200] > 0 and statuses[400] > 0
    assert httpx.get(f"{srv.url}/health").status_code == 200
    assert srv.proc.poll() is None
    wait_clean(srv, within=10.0)


def test_api_key_on_every_v1_endpoint_and_metrics(srv: ServerProcess) -> None:
    doc = httpx.get(f"{srv.url}/openapi.json", headers=srv.headers).json()
    routes = [(m.upper(), p) for p, ops in doc["paths"].items() for m in ops]
    guarded = [(m, p) for m, p in routes if p.startswith(("/v1", "/internal"))]
    assert {p for _, p in guarded} >= {"/v1/chat/completions", "/v1/completions", "/v1/models"}
    guarded += [("GET", "/metrics"), ("GET", "/openapi.json")]
    body = {"messages": MSG, "prompt": "hi", "max_tokens": 1}
    served = httpx.get(f"{srv.url}/v1/models", headers=srv.headers).json()["data"][0]["id"]
    for method, template in guarded:
        path = template.replace("{model}", served)  # GET /v1/models/{model}
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}):  # fmt: skip
            r = httpx.request(method, srv.url + path, headers=headers, json=body, timeout=30)
            assert _openai_error(r, 401)["type"] == "authentication_error", (method, path)
        ok = httpx.request(method, srv.url + path, headers=srv.headers, json=body, timeout=30)
        assert ok.status_code == 200, (method, path, ok.text)
    assert httpx.get(f"{srv.url}/health").status_code == 200  # probes carry no key


def test_request_body_size_limit(srv: ServerProcess) -> None:
    url = f"{srv.url}/v1/chat/completions"
    small = {"messages": MSG, "max_tokens": 1, "user": "u" * (BODY_LIMIT - 200)}
    assert httpx.post(url, json=small, headers=srv.headers, timeout=30).status_code == 200
    big = {**small, "user": "u" * (BODY_LIMIT + 1)}
    err = _openai_error(httpx.post(url, json=big, headers=srv.headers, timeout=30), 413)
    assert str(BODY_LIMIT) in err["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit must count the bytes
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(BODY_LIMIT // 1024 + 2):
            yield b"x" * 1024
        yield b'"}], "max_tokens": 1}'

    r = httpx.post(
        url, content=chunks(), headers={**srv.headers, "content-type": "application/json"}
    )
    assert "content-length" not in r.request.headers
    _openai_error(r, 413)
    # A declared length far beyond the limit is refused before a byte of the body is read.
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        sock.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {10**12}\r\n\r\n{{".encode()
        )
        head = sock.recv(4096).decode(errors="replace")
    assert head.startswith("HTTP/1.1 413"), head
    # A small Content-Length next to Transfer-Encoding: chunked: the server frames the body by
    # the chunks, so a body far over the limit must still be refused.
    head = _send_chunked(srv, {"Content-Length": "10"}, b"x" * (4 * BODY_LIMIT))
    assert head.startswith("HTTP/1.1 413"), head
    wait_clean(srv)


def _send_chunked(srv: ServerProcess, headers: dict[str, str], body: bytes) -> str:
    """Send `body` chunked over a raw socket; the status line and headers of the reply."""
    lines = [
        "POST /v1/chat/completions HTTP/1.1", "Host: x", f"Authorization: Bearer {KEY}",
        "Content-Type: application/json", "Transfer-Encoding: chunked",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]  # fmt: skip
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        try:
            for i in range(0, len(body), 8192):
                part = body[i : i + 8192]
                sock.sendall(b"%x\r\n%s\r\n" % (len(part), part))
            sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server answered and closed before the whole body went out
        return sock.recv(4096).decode(errors="replace")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": CONTEXT}, None),
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": 10**30}, "max_tokens"),
        ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 2**64}, None),
        ("/v1/chat/completions", {"messages": MSG, "top_k": 10**30}, "top_k"),
        ("/v1/chat/completions", {"messages": MSG, "stop_token_ids": [2**64]}, None),
        ("/v1/chat/completions", {"messages": MSG, "n": 10**30}, "n"),
        ("/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": {"x": 10**30}}, None),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 400}]}, None),
        ("/v1/completions", {"prompt": [1, 10**30], "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": [[-(10**30)]], "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": [5] * CONTEXT, "max_tokens": 1}, None),
        ("/v1/completions", {"prompt": "hello " * 300, "max_tokens": 1}, None),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 10**30, "stream": True}, "max_tokens"),
    ],
)
def test_limits_on_max_tokens_and_prompt_length_are_400s(
    srv: ServerProcess, path: str, body: dict[str, Any], param: str | None
) -> None:
    err = _openai_error(httpx.post(srv.url + path, json=body, headers=srv.headers, timeout=30), 400)
    if param is not None:
        assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"
    wait_clean(srv)  # a rejected request leaves nothing behind (no phantom waiting request)


def test_error_bodies_never_carry_stack_traces(srv: ServerProcess) -> None:
    """4xx from the live server, and a 5xx from an unexpected exception in a handler."""
    for method, path, kw in (
        ("POST", "/v1/chat/completions", {"content": b"{bad json"}),
        ("POST", "/v1/completions", {"json": {"prompt": {"deep": [1]}}}),
        ("GET", "/v1/nothing", {}),
        ("DELETE", "/v1/models", {}),
    ):
        r = httpx.request(method, srv.url + path, headers=srv.headers, timeout=30, **kw)
        assert 400 <= r.status_code < 500 and "error" in r.json()
        _no_trace(r)

    from minisgl.config import ServerArgs
    from minisgl.server.api_server import Hooks, build_app
    from minisgl.server.context import ServerContext

    ctx = ServerContext(args=ServerArgs(model="m"), manager=None, metrics=None)  # type: ignore[arg-type]
    app = build_app(ctx, Hooks())  # no lifespan: TestClient is not entered

    async def boom() -> None:
        raise RuntimeError("secret detail /home/user/minisgl/engine.py line 3")

    app.add_api_route("/boom", boom)
    crash: Any = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert crash.status_code == 500 and crash.json()["error"]["type"] == "internal_server_error"
    assert "secret" not in crash.text
    _no_trace(crash)


def test_zz_killed_tokenizer_is_fatal(srv: ServerProcess) -> None:
    """Last in this module (it ends the module's server)."""
    assert_worker_kill_is_fatal(srv, "tokenizer")
