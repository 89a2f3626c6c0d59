"""The server-subprocess helpers the tests and benchmarks share (minisgl/testing/live_server.py):
ready on a 200, given up on when the process exits or the watch raises, stopped by SIGTERM,
by SIGKILL when SIGTERM is ignored, and with its whole process group when asked."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer

import psutil
import pytest

from minisgl.testing.live_server import free_port, stop_process, wait_http_ok

WAIT_S = 60.0


def _python(code: str, **kw) -> subprocess.Popen[bytes]:
    """`python -c code`; it prints a line once it is set up (read it before acting on it)."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, **kw)
    assert proc.stdout is not None and proc.stdout.readline()
    return proc


SLEEPER = "import time; print('up', flush=True); time.sleep(120)"


class _Ok(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:  # quiet
        return


@pytest.fixture
def ok_url() -> Iterator[str]:
    server = HTTPServer(("127.0.0.1", 0), _Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/health"
    server.shutdown()
    server.server_close()


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = _python(SLEEPER)
    yield proc
    proc.kill()
    proc.wait()


def test_ready_once_the_url_answers_200(sleeper: subprocess.Popen[bytes], ok_url: str) -> None:
    assert wait_http_ok(sleeper, ok_url, WAIT_S)
    assert sleeper.poll() is None


def test_not_ready_when_the_process_exits() -> None:
    proc = _python("print('up', flush=True); raise SystemExit(3)")
    assert not wait_http_ok(proc, f"http://127.0.0.1:{free_port()}/health", WAIT_S)
    assert proc.poll() == 3


def test_the_watch_runs_before_each_probe_and_may_give_up(
    sleeper: subprocess.Popen[bytes],
) -> None:
    polls = []

    def watch() -> None:
        polls.append(1)
        if len(polls) == 3:
            raise SystemExit("short of memory")

    nobody = f"http://127.0.0.1:{free_port()}/health"
    with pytest.raises(SystemExit, match="short of memory"):
        wait_http_ok(sleeper, nobody, WAIT_S, interval_s=0.01, each_poll=watch)
    assert len(polls) == 3


def test_stop_sends_sigterm_and_returns_the_exit_code() -> None:
    proc = _python(
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
        "print('up', flush=True)\n"
        "time.sleep(120)"
    )
    assert stop_process(proc, WAIT_S) == 7


def test_stop_kills_what_ignores_sigterm() -> None:
    proc = _python(
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('up', flush=True)\n"
        "time.sleep(120)"
    )
    # SIGTERM is ignored for good, so the short grace does not race anything.
    assert stop_process(proc, 0.2) == -9


def test_stop_of_a_group_takes_the_children_too() -> None:
    spawn = (
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}], stdout=subprocess.PIPE)\n"
        "child.stdout.readline()\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(120)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", spawn], stdout=subprocess.PIPE, start_new_session=True
    )
    assert proc.stdout is not None
    child = psutil.Process(int(proc.stdout.readline()))
    assert stop_process(proc, WAIT_S, group=True) == -15
    assert _gone(child)


def _gone(p: psutil.Process) -> bool:
    """Whether `p` exits within WAIT_S (a zombie nobody reaps counts: it has exited)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False
