"""`python -m minisgl --tp-size 2` on CPU (gloo): same tokens as TP=1, nothing lost or leaked."""

from __future__ import annotations

import signal
import time

import httpx
import psutil
import pytest
from harness import ServerProcess, pid_alive

from minisgl import LLM, SamplingParams

pytestmark = pytest.mark.timeout(300)

PROMPT = [785, 6722, 315, 9625, 374, 1045, 2001, 77, 3000]


def test_tp2_server_first_request_abort_and_shutdown(tiny_model_dir, tmp_path, monkeypatch):
    want = LLM(str(tiny_model_dir), dtype="float32", num_pages=64).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=8)
    )[0]
    # Followers subscribe late on purpose: rank 0's handshake must wait for them.
    monkeypatch.setenv("MINISGL_TP_SUBSCRIBE_DELAY_S", "1.0")
    server = ServerProcess(
        tiny_model_dir, tmp_path / "tp2.log", "--tp-size", "2", "--num-pages", "64"
    )
    try:
        server.wait_ready()
        # The instant the server is up: the very first request must not be lost.
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": "m", "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want.text
        assert r.json()["usage"]["completion_tokens"] == len(want.token_ids)

        ranks = [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)]
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True}
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json={**body, "stream": True}
        ) as s:
            for i, _ in enumerate(s.iter_lines()):
                if i >= 10:
                    break  # disconnect mid-stream: the abort must reach every rank
        deadline = time.monotonic() + 60
        while True:
            stats = server.stats()["scheduler"]
            ranks_stats = stats.get("ranks") or []
            if len(ranks_stats) == 2 and all(
                rs["num_running"] == 0 and rs["num_pages_used"] == 0 for rs in ranks_stats
            ):
                break
            assert time.monotonic() < deadline, f"pages still held: {stats}"
            time.sleep(0.1)
        assert ranks_stats[0] == ranks_stats[1]
    finally:
        server.signal(signal.SIGTERM)
        code = server.proc.wait(60)
    assert code == 0, server.logs()
    deadline = time.monotonic() + 30
    while [pid for pid in ranks if pid_alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in ranks if pid_alive(pid)], "a worker or rank outlived the server"


def test_tp2_server_exits_with_the_rank_error_when_a_rank_fails_to_start(
    tiny_model_dir, tmp_path, monkeypatch
):
    """Before: rank 0 waited in the torch.distributed rendezvous for a dead rank (minutes)."""
    monkeypatch.setenv("MINISGL_TP_SUBSCRIBE_DELAY_S", "not-a-number")  # fails in rank 1 only
    server = ServerProcess(
        tiny_model_dir, tmp_path / "tp2-bad.log", "--tp-size", "2", "--num-pages", "64"
    )
    try:
        code = server.proc.wait(120)
        logs = server.logs()
    finally:
        server.stop()
    assert code == 1, logs
    assert "tensor-parallel rank 1 failed during start-up: ValueError" in logs, logs
    assert "scheduler worker failed to start" in logs, logs
