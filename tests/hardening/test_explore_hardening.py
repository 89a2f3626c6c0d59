"""Exploratory findings on the operator's side: flags, signals, processes."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from minisgl.config import parse_server_args
from minisgl.testing.live_server import free_port

# Out-of-range values of numeric flags, and what used to happen (each seconds into start-up, in
# a worker, with a traceback, or not at all).
BAD_FLAGS = [
    (["--num-pages", "0"], "--num-pages must be >= 1"),  # served with derived pages
    (["--num-pages", "-5"], "--num-pages must be >= 1"),  # negative tensor dimension
    (["--page-size", "0"], "--page-size must be >= 1"),  # ZeroDivisionError
    (["--max-seq-len-override", "0"], "--max-seq-len-override must be >= 1"),  # model's length
    (["--tp-size", "0"], "--tp-size must be >= 1"),  # traceback in the scheduler worker
    (["--max-running-requests", "0"], "--max-running-requests must be >= 1"),
    (["--max-prefill-tokens", "-1"], "--max-prefill-tokens must be >= 1"),
    (["--memory-fraction", "0"], "--memory-fraction must be in (0, 1]"),  # served
    (["--memory-fraction", "nan"], "--memory-fraction must be in (0, 1]"),
    (["--speculative-num-draft-tokens", "0"], "--speculative-num-draft-tokens must be >= 1"),
    (["--port", "70000"], "--port must be in [1, 65535]"),  # bind(): OverflowError traceback
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be >= 0"),
    (["--max-n", "0"], "--max-n must be >= 1"),
    (
        [
            "--speculative-ngram-min-match-window-size",
            "5",
            "--speculative-ngram-max-match-window-size",
            "2",
        ],
        "must not exceed --speculative-ngram-max-match-window-size",
    ),
]


@pytest.mark.parametrize(("flags", "message"), BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_out_of_range_flag_is_one_line_and_exit_2(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_server_args(["--model", "m", *flags])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m minisgl: error: "), lines
    assert message in lines[0]


def test_in_range_edges_accepted() -> None:
    args = parse_server_args(
        ["--model", "m", "--num-pages", "1", "--memory-fraction", "1", "--port", "65535"]
    )
    assert (args.num_pages, args.memory_fraction, args.port) == (1, 1.0, 65535)


def test_cli_refuses_before_starting_anything() -> None:
    """The real entry point: the refusal comes before any worker starts (no model is read:
    the model path does not exist), in one line with exit code 2."""
    out = subprocess.run(
        [sys.executable, "-m", "minisgl", "--model", "/nonexistent", "--page-size", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "python -m minisgl: error: --page-size must be >= 1, got 0"
    ]


def _workers(launcher: psutil.Process) -> list[psutil.Process]:
    """The launcher's worker processes and their tensor-parallel ranks (not the resource
    tracker, which leaves on its own once they are gone)."""
    out = []
    for p in launcher.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "spawn_main" in " ".join(p.cmdline()):
                out.append(p)
    return out


def test_workers_leave_when_the_server_dies_while_they_load(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A server killed during start-up (SIGKILL; or SIGTERM before its handlers are up) used
    to leave its workers loading to the end, and rank 0 waiting for a rank still loading:
    here that rank is held 120 s by a test hook, so before the fix the scheduler and the rank
    outlived the server by ~2 minutes (on a real model: the whole load, and a GPU's memory)."""
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 (closed below)
    env = {**os.environ, "MINISGL_TP_SUBSCRIBE_DELAY_S": "120"}
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "minisgl", "--model", str(tiny_model_dir),
            "--dtype", "float32", "--port", str(free_port()), "--tp-size", "2",
        ],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    launcher = psutil.Process(proc.pid)
    workers: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 4:  # tokenizer, detokenizer, scheduler and rank 1
            assert time.monotonic() < deadline, "the tensor-parallel rank never started"
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            time.sleep(0.2)
            workers = _workers(launcher)
        proc.kill()
        proc.wait()
        _, alive = psutil.wait_procs(workers, timeout=20)
        assert not alive, f"workers still running 20 s after the server died: {alive}"
    finally:
        for p in workers:
            with contextlib.suppress(psutil.Error):
                p.kill()
        log.close()
    ipc = re.search(r"ipc dir (\S+)", (tmp_path / "server.log").read_text())
    assert ipc is not None
    # The server was killed: the workers, leaving, removed its socket directory.
    assert not os.path.exists(ipc.group(1))


BAD_BENCH_FLAGS = [
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),  # an empty report, exit code 0
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),  # ran unlimited
    (["--max-concurrency", "-1"], "--max-concurrency must be >= 1"),  # Semaphore traceback
    (["--request-rate", "0"], "--request-rate must be > 0"),  # ZeroDivisionError traceback
    (["--random-output-len", "0"], "--random-output-len must be >= 1"),  # every request a 400
    (["--random-range-ratio", "2"], "--random-range-ratio must be in [0, 1]"),  # traceback
    (["--extra-request-body", "{top_k: 1}"], "--extra-request-body is not JSON"),  # traceback
]


@pytest.mark.parametrize(
    ("flags", "message"), BAD_BENCH_FLAGS, ids=[" ".join(f) for f, _ in BAD_BENCH_FLAGS]
)
def test_bench_refuses_bad_flags_in_one_line(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from minisgl.bench.cli import main

    # Nothing listens there: the refusal must come before any request.
    with pytest.raises(SystemExit) as exc:
        main(["--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "2", *flags])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("python -m minisgl.bench: error: "), lines
    assert message in lines[0]


def test_bench_against_no_server_is_one_line_and_exit_1() -> None:
    """It was httpx's ConnectError traceback."""
    url = f"http://127.0.0.1:{free_port()}"
    out = subprocess.run(
        [sys.executable, "-m", "minisgl.bench", "--base-url", url, "--num-prompts", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"python -m minisgl.bench: error: {url}: ")
    assert "ConnectError" in lines[0]
