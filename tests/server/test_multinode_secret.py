"""The multi-node ports (PORT+1 step broadcast, PORT+2 acks, PORT+3 node link) against a
stranger on loopback: without the group's secret it receives nothing and changes nothing,
malformed messages (even from a peer holding the secret) leave the group serving, a
connect-and-close on the link before node 1 joins does not take node 0 down, and the ports
are bound to the --dist-init-addr host only. A group without a secret never starts."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import psutil
import pytest
import zmq
from harness import ServerProcess, free_port
from openai import OpenAI
from test_multinode import free_port_block

pytestmark = pytest.mark.timeout(600)

PROMPT = "my password is hunter2"
NODE_FLAGS = ("--tp-size", "2", "--nnodes", "2", "--device", "cpu", "--num-pages", "64")


def _node1(model_dir: Path, addr: str, log: Path, secret: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "minisgl", "--model", str(model_dir), "--dtype", "float32"]
    cmd += [*NODE_FLAGS, "--dist-init-addr", addr, "--node-rank", "1"]
    cmd += ["--port", str(free_port())]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MINISGL_NODE_SECRET": secret}
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _wait_listening(port: int, within: float = 180.0) -> None:
    deadline = time.monotonic() + within
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on {port}"
            time.sleep(0.2)


def _curve_client(sock: zmq.Socket, secret: bytes) -> None:
    """A CURVE client that derives its keys as the group does, from `secret`."""
    from minisgl.engine import curve

    curve.connect_as_client(sock, secret)


def _leaked_server_key(sock: zmq.Socket, secret: bytes) -> None:
    """A CURVE client that knows rank 0's public key (say it leaked) but not the secret."""
    from minisgl.engine import curve

    public, private = zmq.curve_keypair()
    sock.curve_serverkey = curve.server_key(secret)
    sock.curve_publickey, sock.curve_secretkey = public, private


class Stranger:
    """Someone on the network without the secret: subscribers on the step broadcast and
    pushers on the acks port, plain, with keys from a wrong secret, and with the server's
    public key but no client key of the group."""

    def __init__(self, base: int, secret: bytes) -> None:
        self.ctx = zmq.Context()
        self.subs = []
        ways = (
            lambda s: None,
            lambda s: _curve_client(s, secrets.token_bytes(32)),
            lambda s: _leaked_server_key(s, secret),
        )
        for way in ways:
            sub = self.ctx.socket(zmq.SUB)
            way(sub)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"tcp://127.0.0.1:{base + 1}")
            self.subs.append(sub)
        for way in ways:
            push = self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.SNDTIMEO, 0)
            way(push)
            push.connect(f"tcp://127.0.0.1:{base + 2}")
            for msg in (msgpack.packb([1, {"bogus": 1}]), msgpack.packb(1), b"\xc1junk"):
                with contextlib.suppress(zmq.Again):  # queued, or refused at once
                    push.send(msg)
            self.subs.append(push)

    def received(self, wait_s: float = 0.0) -> list[bytes]:
        """What the subscribers hold, after waiting up to `wait_s` for a first message."""
        got = []
        deadline = time.monotonic() + wait_s
        for sub in self.subs:
            timeout_ms = max(0, int((deadline - time.monotonic()) * 1000))
            while sub.type == zmq.SUB and sub.poll(timeout_ms):
                got.append(sub.recv())
                timeout_ms = 0
        return got

    def close(self) -> None:
        for s in self.subs:
            s.close(0)
        self.ctx.term()


def _poke_the_link(port: int) -> None:
    """Connect-and-close, garbage, and a wrong proof on the node link."""
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n" + os.urandom(200))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.recv(100)
        s.sendall(os.urandom(64))  # a nonce and a tag made without the secret
        s.settimeout(5)
        assert s.recv(100) == b"", "node 0 answered a wrong proof"


def _listening_addresses(pid: int, ports: range) -> set[str]:
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return {
        c.laddr.ip
        for p in procs
        for c in p.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port in ports
    }


@pytest.fixture
def stranger_run(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> Iterator[dict]:
    secret = secrets.token_hex(32)
    monkeypatch.setenv("MINISGL_NODE_SECRET", secret)
    base = free_port_block()
    addr = f"127.0.0.1:{base}"
    node0 = ServerProcess(tiny_model_dir, tmp_path / "node0.log", *NODE_FLAGS,
                          "--dist-init-addr", addr, "--node-rank", "0")  # fmt: skip
    procs: list[subprocess.Popen] = []
    try:
        yield {"node0": node0, "base": base, "addr": addr, "secret": secret, "procs": procs}
    finally:
        node0.stop()
        for p in procs:
            _stop(p)


def test_a_stranger_on_the_node_ports_gets_nothing_and_changes_nothing(
    stranger_run: dict, tiny_model_dir: Path, tmp_path: Path
) -> None:
    node0, base, secret = stranger_run["node0"], stranger_run["base"], stranger_run["secret"]
    _wait_listening(base + 3)
    # Before node 1 joins: the link must not count a stranger as a node (it used to, and its
    # close took node 0 down).
    _poke_the_link(base + 3)
    stranger = Stranger(base, secret.encode())
    try:
        # A node with the wrong secret is refused and says why; node 0 waits on.
        wrong = _node1(tiny_model_dir, stranger_run["addr"], tmp_path / "wrong.log", "x" * 32)
        stranger_run["procs"].append(wrong)
        assert wrong.wait(120) != 0
        assert "same secret" in (tmp_path / "wrong.log").read_text(errors="replace")
        assert node0.proc.poll() is None, node0.logs()

        node1 = _node1(tiny_model_dir, stranger_run["addr"], tmp_path / "node1.log", secret)
        stranger_run["procs"].append(node1)
        try:
            node0.wait_ready()
        except RuntimeError as e:
            raise AssertionError(f"{e}\nnode 1:\n{(tmp_path / 'node1.log').read_text()}") from None
        client = OpenAI(base_url=f"{node0.url}/v1", api_key="x", max_retries=0, timeout=120)
        first = client.completions.create(
            model="m", prompt=PROMPT, max_tokens=6, temperature=0.8, seed=7
        )
        # The stranger saw no step (no prompt ids, no seed) and pushed nothing through.
        assert stranger.received(wait_s=1.0) == []
        ranks = _ranks(node0)
        assert len(ranks) == 2 and ranks[0] == ranks[1]

        # A peer holding the secret sends malformed acks: logged and dropped, never a crash.
        _insider_sends_garbage(base, secret.encode(), node0)
        ranks = _ranks(node0)
        assert len(ranks) == 2 and ranks[0] == ranks[1]
        again = client.completions.create(
            model="m", prompt=PROMPT, max_tokens=6, temperature=0.8, seed=7
        )
        assert again.choices[0].text == first.choices[0].text
        assert stranger.received() == []
    finally:
        stranger.close()
    assert node0.proc.poll() is None and node1.poll() is None
    logs = node0.logs()
    assert "node link: dropped 127.0.0.1: failed the handshake" in logs
    assert "dropped a connection that failed the handshake" in logs
    assert "refused 127.0.0.1: not the group's key" in logs
    # Bound where node 1 reaches node 0 (the --dist-init-addr host), not every interface: the
    # group's store (base) too, which torch's own listener offered on every one.
    assert _listening_addresses(node0.proc.pid, range(base, base + 4)) == {"127.0.0.1"}


def _ranks(node0: ServerProcess) -> list[dict]:
    """Every rank's own stats (what rank 0 gathers over the acks port), once both are idle."""
    deadline = time.monotonic() + 60
    while True:
        ranks = node0.stats()["scheduler"].get("ranks") or []
        if len(ranks) == 2 and all(r["num_running"] == 0 for r in ranks):
            return ranks
        assert time.monotonic() < deadline, ranks
        time.sleep(0.2)


def _insider_sends_garbage(base: int, secret: bytes, node0: ServerProcess) -> None:
    """Until rank 0 has read them (it reads the acks port while gathering stats, every
    0.25 s when idle) and said so in its log."""
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    _curve_client(push, secret)
    push.connect(f"tcp://127.0.0.1:{base + 2}")
    for msg in (
        msgpack.packb([1, {"bogus": 1}]),
        msgpack.packb([1, "stats"]),
        msgpack.packb(["up", "one", 2]),
        msgpack.packb(99),
        b"\xc1 not msgpack",
    ):
        push.send(msg)
    try:
        deadline = time.monotonic() + 60
        while "dropped a malformed stats reply" not in node0.logs():
            assert time.monotonic() < deadline, node0.logs()
            assert node0.proc.poll() is None, node0.logs()
            time.sleep(0.2)
    finally:
        push.close(0)
        ctx.term()


def _refusal(model_dir: Path, *extra: str, env: dict[str, str] | None = None) -> str:
    cmd = [sys.executable, "-m", "minisgl", "--model", str(model_dir), *NODE_FLAGS]
    cmd += ["--dist-init-addr", "127.0.0.1:29500", *extra]
    base_env = {k: v for k, v in os.environ.items() if k != "MINISGL_NODE_SECRET"}
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, env={**base_env, **(env or {})}
    )
    assert out.returncode != 0
    return out.stderr


def test_a_group_without_a_usable_secret_does_not_start(tiny_model_dir: Path, tmp_path: Path):
    for node in ("0", "1"):
        err = _refusal(tiny_model_dir, "--node-rank", node)
        assert "--node-secret-file" in err and "MINISGL_NODE_SECRET" in err, err
    err = _refusal(tiny_model_dir, env={"MINISGL_NODE_SECRET": "short"})
    assert "at least 16" in err, err
    err = _refusal(tiny_model_dir, "--node-secret-file", str(tmp_path / "absent"))
    assert "cannot read --node-secret-file" in err, err
