"""What /metrics counts of requests a live server answered.

A request refused with a 400 never ran: it is no finished request in /metrics.

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
            elif s.name in ("minisgl_prompt_tokens_total", "minisgl_generation_tokens_total"):
                counts[s.name.split("_")[1]] = s.value
    assert set(counts) == {*REASONS, "e2e", "prompt", "generation"}
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


def test_token_counters_match_usage_for_lists_of_prompts_with_samples(
    server: ServerProcess,
) -> None:
    """Prompt tokens are counted as usage counts them: each prompt once, whatever n (a list
    of 2 prompts with n = 2 counted each prompt twice: 8 prompt tokens for a usage of 4)."""
    url = f"{server.url}/v1/completions"
    for body in (
        {"prompt": "hello world", "n": 3},
        {"prompt": ["hello world", "the end of it"], "n": 2},
        {"prompt": ["hello world", "the end of it"], "n": 2, "stream": True},
    ):
        before = _counts(server)
        r = httpx.post(url, json={**body, "max_tokens": 3, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        if body.get("stream"):
            usage = httpx.post(
                url, json={**body, "stream": False, "max_tokens": 3, "ignore_eos": True}
            ).json()["usage"]
            want_prompt = 2 * usage["prompt_tokens"]  # this request and the one for its usage
            want_generated = 2 * usage["completion_tokens"]
        else:
            want_prompt = r.json()["usage"]["prompt_tokens"]
            want_generated = r.json()["usage"]["completion_tokens"]
        after = _counts(server)
        assert after["prompt"] - before["prompt"] == want_prompt, body
        assert after["generation"] - before["generation"] == want_generated, body


def test_a_request_is_a_prompt_whatever_n(server: ServerProcess) -> None:
    """docs/metrics.md: requests_total counts one per prompt, its n samples together. A single
    prompt with n = 3 counted one, a list of 2 prompts with n = 3 counted 6 (one per sample)."""
    url = f"{server.url}/v1/completions"
    for body, prompts in (
        ({"prompt": "hello world", "n": 3}, 1),
        ({"prompt": ["hello world", "the end of it"], "n": 3}, 2),
        ({"prompt": ["hello world", "the end of it"], "n": 3, "stream": True}, 2),
        ({"prompt": ["hello world", "the end of it", "more"]}, 3),
    ):
        before = _counts(server)
        r = httpx.post(url, json={**body, "max_tokens": 3, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        server.wait_idle()
        after = _counts(server)
        assert after["length"] - before["length"] == prompts, body
        assert after["e2e"] - before["e2e"] == prompts, body
        assert after["generation"] - before["generation"] == 3 * prompts * body.get("n", 1)
