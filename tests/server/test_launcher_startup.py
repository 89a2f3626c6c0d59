"""The launcher before it serves: a port in use, and SIGTERM while the workers load."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from minisgl.server.launcher import bind_listeners
from minisgl.testing.live_server import free_port


@pytest.fixture
def tmpdir_env() -> Iterator[Path]:
    """A TMPDIR of the server's own (short: ipc socket paths are limited to 107 bytes), to see
    whether its socket directory is left behind."""
    root = Path(tempfile.mkdtemp(prefix="ls-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _launch(model: Path, port: int, tmp: Path, *extra: str, **env: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "minisgl", "--model", str(model), "--dtype", "float32",
           "--port", str(port), "--log-level", "info", *extra]  # fmt: skip
    full_env = {**os.environ, "TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1", **env}
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env
    )


def _workers(launcher: psutil.Process) -> list[psutil.Process]:
    """Spawned workers and their ranks (not the resource tracker, which leaves by itself)."""
    out = []
    for p in launcher.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "spawn_main" in " ".join(p.cmdline()):
                out.append(p)
    return out


def test_port_in_use_fails_before_any_worker_starts(tiny_model_dir: Path, tmpdir_env: Path) -> None:
    """Used to load every worker first (~15 s here, minutes for a real model), then exit."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = _launch(tiny_model_dir, port, tmpdir_env)
        launcher = psutil.Process(proc.pid)
        spawned: set[int] = set()
        try:
            while proc.poll() is None:
                with contextlib.suppress(psutil.Error):
                    spawned.update(p.pid for p in _workers(launcher))
                time.sleep(0.02)
        finally:
            for pid in spawned:
                with contextlib.suppress(psutil.Error):
                    psutil.Process(pid).kill()
        out = proc.communicate()[0]
    assert proc.returncode == 1, out
    assert not spawned, f"workers started before the port was checked:\n{out}"
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out
    assert f"cannot listen on 127.0.0.1 port {port}: Address already in use" in lines[0]
    assert list(tmpdir_env.glob("minisgl-*")) == []


def test_sigterm_while_workers_load_stops_them_and_exits_0(
    tiny_model_dir: Path, tmpdir_env: Path
) -> None:
    """Before uvicorn ran, SIGTERM killed the launcher at once (exit 143): socket directory
    left behind, workers left to notice by themselves. Tensor-parallel rank 1 is held 120 s
    by a test hook, so the scheduler is still loading when the signal comes."""
    proc = _launch(
        tiny_model_dir, free_port(), tmpdir_env, "--tp-size", "2",
        MINISGL_TP_SUBSCRIBE_DELAY_S="120",
    )  # fmt: skip
    launcher = psutil.Process(proc.pid)
    workers: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 4:  # tokenizer, detokenizer, scheduler and rank 1
            assert time.monotonic() < deadline, "the tensor-parallel rank never started"
            assert proc.poll() is None, proc.communicate()[0]
            time.sleep(0.2)
            workers = _workers(launcher)
        assert list(tmpdir_env.glob("minisgl-*")), "no ipc dir while loading"
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
        _, alive = psutil.wait_procs(workers, timeout=20)
    finally:
        for p in workers:
            with contextlib.suppress(psutil.Error):
                p.kill()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert "SIGTERM received during start-up" in out and "stopped during start-up" in out
    assert not alive, f"workers still running after the server exited: {alive}"
    assert list(tmpdir_env.glob("minisgl-*")) == [], out


@pytest.mark.parametrize(
    ("host", "family"),
    [("127.0.0.1", socket.AF_INET), ("0.0.0.0", socket.AF_INET), ("::1", socket.AF_INET6)],
)
def test_listeners_bind_like_uvicorn(host: str, family: socket.AddressFamily) -> None:
    """Bound early and handed to uvicorn: the same sockets its create_server would bind."""
    socks = bind_listeners(host, 0)
    try:
        assert [s.family for s in socks] == [family]
        assert socks[0].getsockname()[0] == host
        if family == socket.AF_INET6:  # as asyncio's: "::" does not take IPv4 too
            assert socks[0].getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
        with pytest.raises(OSError, match="in use"):
            bind_listeners(host, socks[0].getsockname()[1])
    finally:
        for s in socks:
            s.close()
