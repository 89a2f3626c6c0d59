"""Auth, admission control, SIGTERM drain and worker death, each on a server of its own."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import COMMON_FLAGS
from harness import ServerProcess, pid_alive
from sse import completion_text

KEY = "sk-test-secret"


@pytest.fixture(scope="module")
def guarded(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """--api-key, one running request at a time, one waiting at most, a 60 s drain."""
    log = tmp_path_factory.mktemp("guarded") / "server.log"
    flags = ("--api-key", KEY, "--max-running-requests", "1", "--max-queued-requests", "1",
             "--shutdown-timeout", "60", "--served-model-name", "tiny-qwen,qwen3")  # fmt: skip
    srv = ServerProcess(tiny_model_dir, log, *COMMON_FLAGS, *flags).wait_ready()
    yield srv
    srv.stop()


def test_api_key_is_required_on_v1(guarded: ServerProcess) -> None:
    url = f"{guarded.url}/v1/models"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(url, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    bad = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in good.models.list().data] == ["tiny-qwen", "qwen3"]
    assert httpx.get(f"{guarded.url}/internal/stats").status_code == 401
    assert httpx.get(f"{guarded.url}/health").status_code == 200  # probes carry no key


def test_every_served_name_is_listed_and_retrievable(guarded: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=KEY, max_retries=0)
    for name in ("tiny-qwen", "qwen3"):
        card = client.models.retrieve(name)  # GET /v1/models/{model}: was a 404
        assert card.id == name and card.object == "model"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4")
    assert err.value.body["param"] == "model"  # type: ignore[index]
    # A single-model server still answers whatever model a request names.
    for name in ("qwen3", "tiny-qwen", "anything-else"):
        r = client.completions.create(model=name, prompt="hi", max_tokens=2)
        assert r.model == "tiny-qwen" and r.choices[0].finish_reason == "length"


def test_two_servers_use_private_socket_dirs(guarded: ServerProcess, server: ServerProcess) -> None:
    a, b = guarded.stats()["ipc_dir"], server.stats()["ipc_dir"]
    assert a != b and os.path.isdir(a) and os.path.isdir(b)
    assert oct(os.stat(a).st_mode & 0o777) == "0o700"


def _wait_for(condition: Any, srv: ServerProcess, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, srv.stats()
        time.sleep(0.05)


def test_full_waiting_queue_answers_503(guarded: ServerProcess) -> None:
    url = f"{guarded.url}/v1/completions"
    long = {"prompt": "x", "max_tokens": 3000, "ignore_eos": True}
    codes: list[int] = []

    def hold() -> None:
        r = httpx.post(url, json=long, headers=guarded.headers, timeout=120.0)
        codes.append(r.status_code)

    # The scheduler is paused (SIGSTOP) once the first request runs, so neither request can
    # finish while the third arrives: on a fast CPU 3000 tiny-model tokens take only seconds.
    scheduler = guarded.stats()["workers"]["scheduler"]
    threads = [threading.Thread(target=hold) for _ in range(2)]
    threads[0].start()

    def first_runs() -> bool:  # one snapshot: accepted and already producing output
        stats = guarded.stats()
        return stats["in_flight"] == 1 and stats["waiting_at_api"] == 0

    _wait_for(first_runs, guarded)
    os.kill(scheduler, signal.SIGSTOP)
    try:
        threads[1].start()  # accepted, gets no output: the one waiting place is now taken
        _wait_for(lambda: guarded.stats()["waiting_at_api"] >= 1, guarded)
        r = httpx.post(url, json={**long, "max_tokens": 4}, headers=guarded.headers, timeout=10)
    finally:
        os.kill(scheduler, signal.SIGCONT)
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] and r.json()["error"]["type"] == "service_unavailable_error"
    for t in threads:
        t.join()
    assert codes == [200, 200]  # both held requests still finish once the scheduler resumes
    guarded.wait_idle()
    ok = httpx.post(url, json={**long, "max_tokens": 4}, headers=guarded.headers, timeout=30)
    assert ok.status_code == 200


def test_sigterm_drains_in_flight_stream_then_exits_zero(guarded: ServerProcess) -> None:
    stats = guarded.stats()
    workers, ipc_dir = stats["workers"], stats["ipc_dir"]
    assert set(workers) == {"tokenizer", "detokenizer", "scheduler"}
    url = f"{guarded.url}/v1/completions"
    body = {"prompt": "drain me", "max_tokens": 150, "ignore_eos": True, "temperature": 0,
            "stream": True}  # fmt: skip
    lines: list[str] = []
    seen: dict[str, Any] = {}
    with httpx.stream("POST", url, json=body, headers=guarded.headers, timeout=60) as r:
        for line in r.iter_lines():
            lines.append(line)
            if len(lines) == 3:
                guarded.signal(signal.SIGTERM)
                # The drain starts on the server's event loop: wait for it, not a fixed time.
                _wait_for(lambda: httpx.get(f"{guarded.url}/health").status_code == 503, guarded)
                seen["health"] = httpx.get(f"{guarded.url}/health").status_code
                seen["new"] = httpx.post(
                    url, json={**body, "stream": False}, headers=guarded.headers
                ).status_code
    events = [ln for ln in lines if ln]
    assert events[-1] == "data: [DONE]"  # the in-flight stream finished
    import json

    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert completion_text(payloads)
    assert seen == {"health": 503, "new": 503}
    assert guarded.proc.wait(30) == 0
    assert not any(pid_alive(p) for p in workers.values())
    assert not os.path.exists(ipc_dir)
    assert "draining" in guarded.logs()


def test_sigterm_to_the_whole_group_still_drains_then_exits_zero(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """systemd's default stop (KillMode=control-group) and `kill -- -PGID` send SIGTERM to the
    server and its workers at once: the workers used to leave on it, failing the stream the
    server was draining ("worker died"), and the server exited 1."""
    log = tmp_path_factory.mktemp("group") / "server.log"
    srv = ServerProcess(tiny_model_dir, log, *COMMON_FLAGS).wait_ready()
    try:
        workers = srv.stats()["workers"]
        body = {"prompt": "drain me", "max_tokens": 150, "ignore_eos": True, "temperature": 0,
                "stream": True}  # fmt: skip
        lines: list[str] = []
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 3:
                    for pid in [srv.proc.pid, *workers.values()]:
                        os.kill(pid, signal.SIGTERM)
        events = [ln for ln in lines if ln]
        assert events[-1] == "data: [DONE]", events[-3:]  # the in-flight stream finished
        assert srv.proc.wait(30) == 0
        assert not any(pid_alive(p) for p in workers.values())
        assert "died" not in srv.logs()
    finally:
        srv.stop()


def test_scheduler_killed_makes_the_server_exit_non_zero(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    log = tmp_path_factory.mktemp("doomed") / "server.log"
    srv = ServerProcess(tiny_model_dir, log, *COMMON_FLAGS).wait_ready()
    try:
        stats = srv.stats()
        workers, ipc_dir = stats["workers"], stats["ipc_dir"]
        os.kill(workers["scheduler"], signal.SIGKILL)
        start = time.monotonic()
        code = srv.proc.wait(15)
        assert code != 0
        assert time.monotonic() - start < 10
        assert not any(pid_alive(p) for p in workers.values())
        assert not os.path.exists(ipc_dir)
        assert "scheduler worker" in srv.logs() and "died" in srv.logs()
    finally:
        srv.stop()


def test_a_killed_server_s_workers_leave_and_remove_its_sockets(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """kill -9 of the server: its workers notice and leave, and the first to notice removes
    the socket directory the server can no longer remove (one was left in /tmp per kill)."""
    log = tmp_path_factory.mktemp("killed") / "server.log"
    srv = ServerProcess(tiny_model_dir, log, *COMMON_FLAGS).wait_ready()
    try:
        stats = srv.stats()
        workers, ipc_dir = stats["workers"], stats["ipc_dir"]
        assert os.path.isdir(ipc_dir)
        srv.proc.kill()
        srv.proc.wait(15)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and (
            os.path.exists(ipc_dir) or any(pid_alive(p) for p in workers.values())
        ):
            time.sleep(0.1)
        assert not any(pid_alive(p) for p in workers.values())
        assert not os.path.exists(ipc_dir)
    finally:
        srv.stop()


def test_ready_only_after_the_attention_warm_up(guarded: ServerProcess) -> None:
    """The fixture waited for /health 200; by then the scheduler had run the engine's warm-up
    (a prefill and a decode through the attention backend), before it reported the model
    loaded, which is what readiness waits for."""
    logs = guarded.logs()
    warm = logs.find("warm-up: a prefill and a decode through the torch attention backend")
    assert 0 <= warm < logs.find("model loaded in"), logs[-3000:]
