"""A server subprocess's life for tests and benchmarks: a free loopback port to give it, polling
its URL until it answers, and stopping it (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable

import httpx


def free_port() -> int:
    """A loopback port nothing listens on now (the kernel's pick; free until someone binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http_ok(
    proc: subprocess.Popen[bytes],
    url: str,
    timeout_s: float,
    *,
    interval_s: float = 0.2,
    probe_timeout_s: float = 1.0,
    each_poll: Callable[[], None] | None = None,
) -> bool:
    """Polls `url` until it answers 200 (True), or until `proc` exits or `timeout_s` passes
    (False; `proc.poll()` tells which). `each_poll` runs before each probe while `proc` lives
    (a caller's watch; it may raise to give up)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if each_poll is not None:
            each_poll()
        try:
            if httpx.get(url, timeout=probe_timeout_s).status_code == 200:
                return True
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(interval_s)
    return False


def stop_process(
    proc: subprocess.Popen[bytes], timeout_s: float = 30.0, *, group: bool = False
) -> int:
    """SIGTERM, and SIGKILL if it has not exited within `timeout_s`; its exit code. `group`: the
    signals go to its whole process group (a server started with start_new_session=True, so
    that the workers it spawned go too)."""
    if proc.poll() is None:
        _send(proc, signal.SIGTERM, group)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _send(proc, signal.SIGKILL, group)
    return proc.wait()  # its exit code (after a SIGKILL, once it has gone)


def _send(proc: subprocess.Popen[bytes], sig: int, group: bool) -> None:
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
