"""The playground: a chat page at `/` and `/playground`, from static files in the package.

Plain HTML/CSS/JS (minisgl/server/static/), no build step and nothing fetched from elsewhere:
the page works offline, and its URLs are all relative so it works behind an Ingress path
prefix. It talks to the server's own OpenAI endpoints, with the user's API key if one is set.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

from minisgl.server.errors import error_response

_ASSETS = {  # file -> media type; nothing else in static/ is served
    "playground.css": "text/css; charset=utf-8",
    "playground.js": "text/javascript; charset=utf-8",
}
_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}


def _read(name: str) -> bytes:
    return (resources.files("minisgl.server") / "static" / name).read_bytes()


def install_playground(app: FastAPI) -> None:
    page = _read("index.html")
    assets = {name: (_read(name), media) for name, media in _ASSETS.items()}

    @app.get("/", include_in_schema=False)
    @app.get("/playground", include_in_schema=False)
    async def playground() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=_HEADERS)

    @app.get("/playground/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in assets:
            return error_response(404, f"no such playground file: {name}")
        body, media = assets[name]
        return Response(body, media_type=media, headers=_HEADERS)
