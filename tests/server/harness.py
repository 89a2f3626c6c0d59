"""A live `python -m minisgl` subprocess for tests: start, wait until ready, stop."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from minisgl.testing.live_server import free_port, stop_process, wait_http_ok

READY_TIMEOUT = 180.0


class ServerProcess:
    def __init__(self, model_dir: Path, log_path: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [
            sys.executable, "-m", "minisgl",
            "--model", str(model_dir),
            "--dtype", "float32",
            "--port", str(self.port),
            *extra,
        ]  # fmt: skip
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.api_key = None
        if "--api-key" in extra:
            self.api_key = extra[list(extra).index("--api-key") + 1]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self) -> ServerProcess:
        if wait_http_ok(self.proc, f"{self.url}/health", READY_TIMEOUT):
            return self
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()}")
        raise RuntimeError(f"server not ready in {READY_TIMEOUT} s:\n{self.logs()}")

    def logs(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stats(self) -> dict[str, Any]:
        r = httpx.get(f"{self.url}/internal/stats", headers=self.headers, timeout=5.0)
        r.raise_for_status()
        return r.json()

    def wait_idle(self, within: float = 60.0) -> dict[str, Any]:
        """Scheduler stats once 0 requests run and 0 KV pages are used; fails after `within` s."""
        deadline = time.monotonic() + within
        while True:
            s = self.stats()["scheduler"]
            if (
                s.get("num_running") == 0
                and s.get("num_waiting") == 0
                and s.get("num_pages_used") == 0
            ):
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"not idle after {within} s: {s}")
            time.sleep(0.05)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> int:
        code = stop_process(self.proc, 30)
        self._log.close()
        return code


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
