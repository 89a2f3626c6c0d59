"""Starting a real minisgl server and a real Prometheus on loopback for the live tests."""

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

from minisgl.testing.live_server import free_port, stop_process, wait_http_ok


def _stop(proc: subprocess.Popen[bytes]) -> None:
    stop_process(proc, timeout_s=20.0)


def _wait_http(proc: subprocess.Popen[bytes], url: str, timeout_s: float, log: Path) -> None:
    if wait_http_ok(proc, url, timeout_s, probe_timeout_s=2.0):
        return
    if proc.poll() is not None:
        raise RuntimeError(f"{url}: process exited {proc.returncode}\n{log.read_text()[-3000:]}")
    raise RuntimeError(f"{url} not ready in {timeout_s} s\n{log.read_text()[-3000:]}")


@contextmanager
def minisgl_server(model_dir: Path, name: str, tmp: Path, *extra: str) -> Iterator[str]:
    """`python -m minisgl` on a free loopback port; yields its base URL once /health is 200."""
    port = free_port()
    log = tmp / "minisgl.log"
    cmd = [sys.executable, "-m", "minisgl", "--model", str(model_dir), "--dtype", "float32",
           "--device", "cpu", "--port", str(port), "--served-model-name", name, *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_http(proc, base + "/health", 180.0, log)
        yield base
    finally:
        _stop(proc)


@contextmanager
def prometheus(
    binary: str, target: str, tmp: Path, rule_files: list[Path], labels: dict[str, str]
) -> Iterator[str]:
    """A Prometheus scraping `target` (host:port) every second; yields its base URL."""
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [
            {"job_name": "minisgl", "static_configs": [{"targets": [target], "labels": labels}]}
        ],
    }
    config_file = tmp / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    log = tmp / "prometheus.log"
    cmd = [binary, f"--config.file={config_file}", f"--storage.tsdb.path={tmp / 'tsdb'}",
           f"--web.listen-address=127.0.0.1:{port}"]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_http(proc, base + "/-/ready", 60.0, log)
        yield base
    finally:
        _stop(proc)


def query(prom: str, expr: str) -> list[dict[str, Any]]:
    """Instant query through Prometheus's HTTP API; the result vector."""
    resp = httpx.get(prom + "/api/v1/query", params={"query": expr}, timeout=10.0)
    body = resp.json()
    assert resp.status_code == 200 and body["status"] == "success", (expr, body)
    return list(body["data"]["result"])


def scalar(prom: str, expr: str) -> float | None:
    result = query(prom, expr)
    assert len(result) <= 1, (expr, result)
    return float(result[0]["value"][1]) if result else None


def wait_for(prom: str, expr: str, want: float, timeout_s: float = 30.0) -> float | None:
    """Polls until `expr` equals `want` (scrapes and rule evaluations lag a second or two)."""
    deadline = time.monotonic() + timeout_s
    got = None
    while time.monotonic() < deadline:
        got = scalar(prom, expr)
        if got == want:
            return got
        time.sleep(0.5)
    return got


def wait_nonempty(prom: str, expr: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """Polls until `expr` returns samples (a filter such as `x >= 0` drops NaN)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = query(prom, expr)
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.5)
