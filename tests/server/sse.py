"""Reading OpenAI SSE streams with httpx (raw, so the wire format itself is checked)."""

from __future__ import annotations

import json
from typing import Any

import httpx


def stream_events(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> list[Any]:
    """All `data:` payloads of a streamed request, JSON-decoded ("[DONE]" kept as a string)."""
    events: list[Any] = []
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def chat_text(events: list[Any]) -> str:
    return "".join(
        c["delta"].get("content") or ""
        for e in events
        if isinstance(e, dict)
        for c in e.get("choices", [])
    )


def completion_text(events: list[Any]) -> str:
    return "".join(
        c.get("text") or "" for e in events if isinstance(e, dict) for c in e.get("choices", [])
    )
