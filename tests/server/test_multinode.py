"""Tensor parallelism over two "nodes" on loopback (`--nnodes 2 --node-rank 0|1`, gloo on CPU):
the same greedy tokens as a TP=1 server through the openai client, and a group that dies as one
(either node killed -> the other exits non-zero within seconds)."""

from __future__ import annotations

import os
import random
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from harness import ServerProcess, free_port, pid_alive
from openai import OpenAI

from minisgl.testing.live_server import stop_process

pytestmark = pytest.mark.timeout(600)

PROMPTS = ["The capital of France is", "1, 2, 3, 4,"]
EXIT_WITHIN_S = 10.0


def free_port_block(n: int = 4) -> int:
    """A port whose next n-1 neighbours are free too (the rendezvous uses PORT..PORT+3)."""
    for _ in range(200):
        base = random.randint(20000, 60000)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free block of ports")


class Group:
    """Node 0 (the server) and node 1 (ranks + /health) of one TP=2 model."""

    def __init__(self, model_dir: Path, tmp: Path) -> None:
        secret = tmp / "node-secret"
        secret.write_text(secrets.token_hex(32) + "\n")
        base = ["--tp-size", "2", "--nnodes", "2", "--device", "cpu", "--num-pages", "64"]
        base += ["--dist-init-addr", f"127.0.0.1:{free_port_block()}"]
        base += ["--node-secret-file", str(secret)]
        self.node0 = ServerProcess(model_dir, tmp / "node0.log", *base, "--node-rank", "0")
        self.health1 = f"http://127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "minisgl", "--model", str(model_dir), "--dtype", "float32"]
        cmd += [*base, "--node-rank", "1", "--port", self.health1.rsplit(":", 1)[1]]
        self.log1 = open(tmp / "node1.log", "wb")  # noqa: SIM115 (closed in stop)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.node1 = subprocess.Popen(cmd, stdout=self.log1, stderr=subprocess.STDOUT, env=env)
        self.tmp = tmp

    def wait_ready(self) -> Group:
        try:
            self.node0.wait_ready()
        except RuntimeError as e:
            raise RuntimeError(f"{e}\nnode 1:\n{self.logs1()}") from None
        deadline = time.monotonic() + 60
        while httpx.get(f"{self.health1}/health", timeout=2).status_code != 200:
            assert time.monotonic() < deadline, self.logs1()
            time.sleep(0.2)
        return self

    def logs1(self) -> str:
        self.log1.flush()
        return (self.tmp / "node1.log").read_text(errors="replace")

    def ranks(self) -> list[int]:
        import psutil

        return [
            p.pid
            for proc in (self.node0.proc, self.node1)
            if pid_alive(proc.pid)
            for p in psutil.Process(proc.pid).children(recursive=True)
        ]

    def stop(self) -> None:
        self.node0.stop()
        stop_process(self.node1, 30)
        self.log1.close()


@pytest.fixture
def group(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Group]:
    g = Group(tiny_model_dir, tmp_path)
    try:
        yield g.wait_ready()
    finally:
        g.stop()


def greedy(url: str) -> list[str]:
    client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    out = []
    for prompt in PROMPTS:
        r = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0)
        out.append(r.choices[0].text)
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0
    )
    out.append(chat.choices[0].message.content or "")
    return out


def test_two_nodes_serve_like_one_rank_and_die_together(group: Group, tiny_model_dir, tmp_path):
    single = ServerProcess(tiny_model_dir, tmp_path / "tp1.log", "--device", "cpu")
    try:
        want = greedy(single.wait_ready().url)
    finally:
        single.stop()
    assert greedy(group.node0.url) == want
    # Rank 1, on node 1, mirrored every step: its scheduler ends idle and in step with rank 0.
    deadline = time.monotonic() + 30
    while True:
        ranks = group.node0.stats()["scheduler"].get("ranks") or []
        if len(ranks) == 2 and all(r["num_running"] == r["num_pages_used"] == 0 for r in ranks):
            break
        assert time.monotonic() < deadline, ranks
        time.sleep(0.1)
    assert ranks[0] == ranks[1]
    _kill_node_1_and_watch_node_0_go(group)


def _exits_nonzero_within(proc: subprocess.Popen, seconds: float) -> int:
    try:
        code = proc.wait(seconds)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running {seconds:.0f} s after its peer died") from None
    assert code != 0
    return code


def _kill_node_1_and_watch_node_0_go(group: Group) -> None:
    """(Part of the test above: a group takes a while to start.)"""
    ranks = group.ranks()
    group.node1.kill()
    t0 = time.monotonic()
    # Node 0 stops saying healthy before it exits.
    saw_unhealthy = False
    while group.node0.proc.poll() is None and time.monotonic() - t0 < EXIT_WITHIN_S:
        try:
            saw_unhealthy |= httpx.get(f"{group.node0.url}/health", timeout=1).status_code != 200
        except httpx.HTTPError:
            saw_unhealthy = True
        time.sleep(0.05)
    _exits_nonzero_within(group.node0.proc, max(0.1, EXIT_WITHIN_S - (time.monotonic() - t0)))
    assert saw_unhealthy, group.node0.logs()
    _assert_gone(ranks)


def test_killing_node_0_takes_node_1_down(group: Group) -> None:
    ranks = group.ranks()
    group.node0.proc.kill()
    _exits_nonzero_within(group.node1, EXIT_WITHIN_S)
    _assert_gone(ranks)


def _assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 15
    while [p for p in pids if pid_alive(p)]:
        assert time.monotonic() < deadline, "a rank or worker outlived its group"
        time.sleep(0.1)


def test_bad_layouts_are_refused_before_anything_starts(tiny_model_dir: Path) -> None:
    for extra, why in (
        (["--tp-size", "3", "--nnodes", "2"], "must divide by --nnodes"),
        (["--tp-size", "2", "--nnodes", "2", "--node-rank", "2"], "--node-rank must be in"),
        (["--tp-size", "2", "--nnodes", "2"], "fixed port"),
    ):
        cmd = [sys.executable, "-m", "minisgl", "--model", str(tiny_model_dir), *extra]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and why in out.stderr, out.stderr


def test_the_api_server_process_never_loads_torch() -> None:
    # Multi-node support must not pull torch into the launcher: its exit (after a lost node,
    # say) would then take seconds of interpreter teardown.
    code = "import sys, minisgl.server.launcher; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
