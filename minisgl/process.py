"""What every worker process shares: logging, signals, readiness report, parent watchdog, and
freezing what start-up built. Below every worker (tokenizer, engine) and the server alike."""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str, name: str) -> logging.Logger:
    logging.basicConfig(
        level=level.upper(), format=LOG_FORMAT, stream=sys.stderr, force=True, datefmt="%H:%M:%S"
    )
    return logging.getLogger(f"minisgl.{name}")


# How the launcher stops its workers (stop_worker). Not SIGTERM: a service manager stopping the
# server (systemd's default KillMode=control-group, `kill -- -PGID`) sends SIGTERM to every
# process of the group at once, and workers that left on it failed the requests the server was
# draining, and the server exited 1 ("worker died").
STOP_SIGNAL = signal.SIGUSR1


def stop_worker(proc: mp.process.BaseProcess) -> None:
    """Ask a worker (WorkerLife, or a process that keeps STOP_SIGNAL's default) to stop."""
    if proc.pid is not None and proc.is_alive():
        os.kill(proc.pid, STOP_SIGNAL)


def ignore_group_signals() -> None:
    """A terminal's Ctrl-C (SIGINT) and a service manager's stop (SIGTERM) reach the whole
    process group: the server orchestrates the drain, then stops its workers itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class WorkerLife:
    """Stop flag for a worker loop.

    STOP_SIGNAL (the launcher's shutdown) sets the flag; SIGINT and SIGTERM, which reach the
    whole process group from a terminal or a service manager, are left to the server, which
    drains its requests and then stops the workers (before loading is over they still end the
    worker: nothing is in flight). The worker also stops when its parent is gone, so a kill -9
    of the server leaves no orphans; it then removes the server's socket directory (`ipc_dir`),
    which the server would have removed on its way out.
    """

    ORPHAN_CHECK_S = 0.5

    def __init__(self, ipc_dir: str | None = None) -> None:
        self.parent_pid = os.getppid()
        self.ipc_dir = ipc_dir
        self.stopping = False
        self.loaded = False
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(STOP_SIGNAL, self._on_signal)
        threading.Thread(
            target=self._leave_if_orphaned_while_loading, name="minisgl-load-watch", daemon=True
        ).start()

    def _leave_if_orphaned_while_loading(self) -> None:
        """While loading, the loop that checks `alive` has not started: a server killed then
        (SIGKILL, or a SIGTERM before its handlers are up) left this worker loading weights and
        timing kernels to the end (and under TP its rank processes with it), only to die on a
        broken pipe: tens of seconds of cores, or a GPU's memory, held for nobody."""
        while not self.loaded:
            if os.getppid() != self.parent_pid:
                logging.getLogger("minisgl.process").warning(
                    "the server (pid %d) is gone while this worker was starting: leaving",
                    self.parent_pid,
                )
                for child in mp.active_children():  # e.g. tensor-parallel ranks still loading
                    child.kill()
                self._remove_ipc_dir()
                logging.shutdown()
                os._exit(1)
            time.sleep(self.ORPHAN_CHECK_S)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if not self.loaded:
            raise SystemExit(0)  # still loading: nothing to finish, leave now
        # Serving: SIGTERM reached the server too, which sends STOP_SIGNAL once it has drained.
        self.stopping = self.stopping or signum == STOP_SIGNAL

    def serving(self) -> None:
        """Loading is over: from now on STOP_SIGNAL lets the loop finish its iteration, and
        SIGTERM is the server's to act on."""
        self.loaded = True

    def alive(self) -> bool:
        if os.getppid() != self.parent_pid:
            self._remove_ipc_dir()
            return False
        return not self.stopping

    def _remove_ipc_dir(self) -> None:
        """The server is gone without removing its sockets (a kill -9): the first of its
        workers to notice does (the others find nothing left)."""
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


def report_ready(conn: Connection, **info: Any) -> None:
    conn.send({"ok": True, **info})
    conn.close()


def report_failure(conn: Connection, exc: BaseException) -> None:
    try:
        conn.send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        conn.close()
    except OSError:
        pass


def leave_with_parent(parent_pid: int) -> None:
    """Start a watchdog thread that ends this helper process once its parent is gone. A
    thread, so it acts even while the main thread is busy in Python code (the GIL changes
    hands), e.g. a render or compile that would otherwise outlive the worker that asked."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="minisgl-parent-watch", daemon=True).start()


class KillableChild:
    """A spawned helper process at the other end of a pipe, for work that may run too long:
    started with the parent's pid as the target's last argument (so it can `leave_with_parent`),
    and stopped by killing it, since a compile or render stuck in native code never looks at a
    flag."""

    KILL_WAIT_S = 5.0

    def __init__(self, target: Callable[..., None], args: tuple[Any, ...], name: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(*args, child, os.getpid()), name=name)
        self.proc.daemon = True
        self.proc.start()
        child.close()

    def alive(self) -> bool:
        return self.proc.is_alive()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(self.KILL_WAIT_S)
        self.conn.close()


def exit_now() -> None:
    """Leave a worker right away once its sockets are closed.

    A normal interpreter exit tears down torch and transformers for seconds; there is nothing
    left to flush but the log stream.
    """
    logging.shutdown()
    sys.stderr.flush()
    os._exit(0)


def elapsed(start: float) -> str:
    return f"{time.perf_counter() - start:.1f} s"


def freeze_startup_objects() -> None:
    """In a process that holds one engine until it exits: everything built so far (modules,
    weights, imported libraries) lives as long as the process, so keep the garbage collector
    from re-walking it during steps (measured: ~5% of a CPU decode step went to
    gc_collect_main). Not for LLM: a frozen object is never collected, and a user may create
    and drop several."""
    gc.collect()
    gc.freeze()
