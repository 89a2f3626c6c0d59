"""A request refused with a 400 never ran: it is no finished request in /metrics.

The engine refuses some bad input only once the request reached it (an invalid grammar, a
context too long). Such a 400 counted as finish_reason="error", and in a list of prompts the
siblings dropped with it as "abort", so a client's typo read on a dashboard as server errors
and users pressing stop. The API server's own 400s (bad fields) were never counted."""

from __future__ import annotations

import httpx
from harness import ServerProcess
from prometheus_client.parser import text_string_to_metric_families

REASONS = ("stop", "length", "abort", "error")


def _counts(server: ServerProcess) -> dict[str, float]:
    body = httpx.get(f"{server.url}/metrics", timeout=10).text
    counts: dict[str, float] = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            if s.name == "minisgl_requests_total":
                counts[s.labels["finish_reason"]] = s.value
            elif s.name == "minisgl_e2e_request_latency_seconds_count":
                counts["e2e"] = s.value
    assert set(counts) == {*REASONS, "e2e"}
    return counts


def test_requests_refused_by_the_engine_count_nowhere(server: ServerProcess) -> None:
    url = f"{server.url}/v1/completions"
    before = _counts(server)
    refused = [
        {"prompt": "hi", "max_tokens": 4, "regex": "[("},
        {"prompt": "hi", "max_tokens": 100_000},
        {"prompt": ["a", "b", "c", "d"], "max_tokens": 4, "regex": "[("},
        {"prompt": ["a", "b", "c", "d"], "max_tokens": 4, "regex": "[(", "stream": True},
        {"prompt": ["a", "b " * 300], "max_tokens": 3900},
        {"prompt": "hi", "max_tokens": 4, "n": 3, "regex": "[("},
    ]
    for body in refused:
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 400, (body, r.text)
    server.wait_idle()
    assert _counts(server) == before
    # A request that runs is counted, once.
    r = httpx.post(url, json={"prompt": ["a", "b"], "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200
    after = _counts(server)
    assert after["length"] == before["length"] + 2
    assert after["e2e"] == before["e2e"] + 2
    assert (after["abort"], after["error"]) == (before["abort"], before["error"])
