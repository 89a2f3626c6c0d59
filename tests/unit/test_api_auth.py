"""The API key guards the API's description too, not only its endpoints."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from minisgl.config import ServerArgs
from minisgl.server.api_server import Hooks, build_app
from minisgl.server.context import ServerContext


def _client(**args: Any) -> TestClient:
    ctx = ServerContext(args=ServerArgs(model="m", **args), manager=None, metrics=None)  # type: ignore[arg-type]
    return TestClient(build_app(ctx, Hooks()))  # not entered: no lifespan, no workers


def test_openapi_needs_the_key_when_one_is_set() -> None:
    client = _client(api_key="sk-1")
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = client.get("/openapi.json", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = client.get("/openapi.json", headers={"Authorization": "Bearer sk-1"})
    assert r.status_code == 200 and "/v1/chat/completions" in r.json()["paths"]


def test_openapi_is_open_without_a_key() -> None:
    assert _client().get("/openapi.json").status_code == 200


def test_no_request_goes_through_base_http_middleware() -> None:
    # Starlette's BaseHTTPMiddleware (what `@app.middleware("http")` installs) runs the app in a
    # task of its own and passes every response chunk between two tasks: API-server CPU on the
    # path of each first token. Every middleware of the app is plain ASGI.
    from starlette.middleware.base import BaseHTTPMiddleware

    app = build_app(
        ServerContext(args=ServerArgs(model="m", api_key="k"), manager=None, metrics=None),  # type: ignore[arg-type]
        Hooks(),
    )
    assert app.user_middleware, "the API key and body limit middlewares are installed"
    assert not [m for m in app.user_middleware if issubclass(m.cls, BaseHTTPMiddleware)]


def test_key_checked_on_guarded_paths_only() -> None:
    client = _client(api_key="sk-1")
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer sk-1"}).status_code == 200
    assert client.get("/health").status_code == 503  # no key needed (here: not ready yet)
    guarded = _client(api_key="sk-1", metrics_require_api_key=True)
    assert guarded.get("/metrics").status_code == 401
