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
