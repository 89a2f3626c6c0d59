"""Requests for many sequences (a prompt list, n > 1): usage, validation and admission.

usage counts each prompt once and only prefix-cache hits of earlier requests as cached; a
prompt list that streams is checked whole before its first byte (a client error is a 400,
not a 200 with an error inside); admission counts sequences (prompts x n), bounded per
request by --max-n and --max-prompts-per-request.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import COMMON_FLAGS
from harness import ServerProcess

from minisgl.config import ServerArgs


def _unique_prompt(words: int) -> str:
    """A prompt no earlier request shares a page with (it opens with a fresh id)."""
    tag = uuid.uuid4().hex
    return f"{tag} " + " ".join(f"w{tag[i % 32]}{i}" for i in range(words))


def _count(server: ServerProcess, prompt: str) -> int:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}, timeout=60)
    return int(r.json()["count"])


# ---- usage ----------------------------------------------------------------------------------
def test_prompt_list_with_n_counts_each_prompt_once(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    prompts = ["one two", "three four"]
    expected = sum(_count(server, p) for p in prompts)
    reply = client.completions.create(model="m", prompt=prompts, n=2, max_tokens=1)
    assert len(reply.choices) == 4
    assert reply.usage is not None and reply.usage.prompt_tokens == expected
    assert reply.usage.total_tokens == expected + reply.usage.completion_tokens
    stream = client.completions.create(
        model="m",
        prompt=prompts,
        n=2,
        max_tokens=1,
        stream=True,
        stream_options={"include_usage": True},
    )
    last = list(stream)[-1]
    assert last.usage is not None and last.usage.prompt_tokens == expected


def _cached(usage: Any) -> int:
    return int(usage.prompt_tokens_details.cached_tokens)


def test_samples_sharing_a_prefill_are_no_cache_hits(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    # A prompt of ~20 pages that no earlier request has seen: nothing is cached, whatever n.
    fresh = [{"role": "user", "content": _unique_prompt(150)}]
    chat = client.chat.completions.create(model="m", messages=fresh, n=4, max_tokens=2)
    assert chat.usage is not None and chat.usage.prompt_tokens > 200
    assert _cached(chat.usage) == 0
    # Asked again: its whole pages (all but the last token's) come from the prefix cache.
    again = client.chat.completions.create(model="m", messages=fresh, n=4, max_tokens=2)
    assert again.usage is not None
    assert _cached(again.usage) == (again.usage.prompt_tokens - 1) // 16 * 16
    # The same on /v1/completions: one prompt, and a prompt list (one engine request each).
    one = client.completions.create(model="m", prompt=_unique_prompt(150), n=4, max_tokens=2)
    assert one.usage is not None and _cached(one.usage) == 0
    batch = [_unique_prompt(150), _unique_prompt(150)]
    listed = client.completions.create(model="m", prompt=batch, n=3, max_tokens=2)
    assert listed.usage is not None and _cached(listed.usage) == 0
    assert listed.usage.prompt_tokens == sum(_count(server, p) for p in batch)


# ---- validation before the first byte -------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": ["ok", "fine"], "regex": "([a-z"}, "regex"),
        ({"prompt": [[11, 12], [11] * 5000, [13]]}, None),
    ],
    ids=["invalid-regex", "prompt-over-context"],
)
def test_streamed_prompt_list_rejects_bad_input_with_400(
    server: ServerProcess, body: dict[str, Any], param: str | None
) -> None:
    request = {"model": "m", "max_tokens": 3, "stream": True, **body}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=request, timeout=600) as r:
        r.read()
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    else:
        assert "context" in error["message"]
    server.wait_idle()  # the valid prompts of the list were dropped with it


# ---- admission ------------------------------------------------------------------------------
def test_default_caps_bound_one_request_by_the_queue() -> None:
    args = ServerArgs(model="m")
    assert args.max_prompts_per_request * args.max_n <= args.max_queued_requests


@pytest.fixture(scope="module")
def queued(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """Four waiting sequences at most; n up to 4; 3 prompts per request."""
    log = tmp_path_factory.mktemp("queued") / "server.log"
    flags = ("--max-running-requests", "1", "--max-queued-requests", "4", "--max-n", "4",
             "--max-prompts-per-request", "3")  # fmt: skip
    srv = ServerProcess(tiny_model_dir, log, *COMMON_FLAGS, *flags).wait_ready()
    yield srv
    srv.stop()


def _post(srv: ServerProcess, body: dict[str, Any], timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/completions", json={"model": "m", **body}, timeout=timeout)


def _wait_for(condition: Any, srv: ServerProcess, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, srv.stats()
        time.sleep(0.05)


def test_caps_per_request_are_400s(queued: ServerProcess) -> None:
    r = _post(queued, {"prompt": ["a", "b", "c", "d"], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "--max-prompts-per-request" in r.json()["error"]["message"]
    # 2 prompts x n=3: more sequences than may ever wait at once.
    r = _post(queued, {"prompt": ["a", "b"], "n": 3, "max_tokens": 1})
    assert r.status_code == 400 and "--max-queued-requests" in r.json()["error"]["message"]
    ok = _post(queued, {"prompt": ["a", "b"], "n": 2, "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


def test_admission_counts_sequences(queued: ServerProcess) -> None:
    """With the scheduler paused nothing leaves the queue: an n=3 request takes three of the
    four places, so two more prompts do not fit (503, nothing of them queued), one does."""
    scheduler = queued.stats()["workers"]["scheduler"]
    codes: list[int] = []

    def held(body: dict[str, Any]) -> None:
        codes.append(_post(queued, {"max_tokens": 2, **body}).status_code)

    os.kill(scheduler, signal.SIGSTOP)
    threads = []
    try:
        threads.append(threading.Thread(target=held, args=({"prompt": "x", "n": 3},)))
        threads[-1].start()
        _wait_for(lambda: queued.stats()["in_flight"] == 1, queued)
        r = _post(queued, {"prompt": ["y", "z"], "max_tokens": 2}, timeout=15)
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"]
        assert queued.stats()["in_flight"] == 1  # none of its prompts was queued
        threads.append(threading.Thread(target=held, args=({"prompt": "w"},)))
        threads[-1].start()
        _wait_for(lambda: queued.stats()["in_flight"] == 2, queued)
        r = _post(queued, {"prompt": "v", "max_tokens": 2}, timeout=15)
        assert r.status_code == 503, r.text
    finally:
        os.kill(scheduler, signal.SIGCONT)
    for t in threads:
        t.join()
    assert codes == [200, 200]
    queued.wait_idle()
