"""The playground's routes and files, in process (no workers needed)."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from minisgl.config import ServerArgs, parse_server_args
from minisgl.server.api_server import Hooks, build_app
from minisgl.server.context import ServerContext

STATIC = resources.files("minisgl.server") / "static"


def _client(**args: Any) -> TestClient:
    ctx = ServerContext(args=ServerArgs(model="m", **args), manager=None, metrics=None)  # type: ignore[arg-type]
    return TestClient(build_app(ctx, Hooks()))  # no `with`: the lifespan (workers) never runs


def test_page_and_assets_are_served() -> None:
    client = _client()
    for path in ("/", "/playground"):
        r = client.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "minisgl playground" in r.text
    css = client.get("/playground/playground.css")
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    js = client.get("/playground/playground.js")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    missing = client.get("/playground/index.html")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404


def test_disable_playground_flag() -> None:
    assert parse_server_args(["--model", "m", "--disable-playground"]).disable_playground
    client = _client(disable_playground=True)
    for path in ("/", "/playground", "/playground/playground.js"):
        assert client.get(path).status_code == 404


def test_page_is_self_contained_with_relative_urls() -> None:
    """Offline and behind an Ingress prefix: nothing from another host, no absolute path."""
    for name in ("index.html", "playground.css", "playground.js"):
        text = (STATIC / name).read_text()
        assert not re.search(r"https?://", text), f"{name} reaches outside the server"
        assert not re.search(r"""(href|src)\s*=\s*["']/""", text), name
        assert not re.search(r"""(fetch\(|new URL\()\s*["'`]/""", text), name
        assert "@import" not in text and "url(" not in text, name


def test_static_files_ship_in_the_package() -> None:
    """A wheel install must carry the files: setuptools packs only declared package data."""
    import tomllib

    config = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert "server/static/*" in config["tool"]["setuptools"]["package-data"]["minisgl"]
    assert {p.name for p in STATIC.iterdir()} >= {"index.html", "playground.css", "playground.js"}
