"""The server's grammar compiles, off the scheduler loop: a thread of the scheduler process feeds
a child process that owns xgrammar's compiler, one grammar at a time.

Compiling in the loop stopped every stream for as long as a compile took (a grammar costs
milliseconds to minutes, at the sender's choice). Here the request waits and nobody else does:
the loop hands the grammar over and goes on stepping. A compile that outlives its bound fails
the requests waiting for it (a 400 with the reason); the child is killed, which stops the work
(a thread could only be abandoned, still burning a core), and the next grammar gets a fresh
child. The child runs at the lowest CPU priority, so on a machine short of cores the model's steps
go first, and its bound counts its CPU time. The compiled grammar comes back serialized (xgrammar's own JSON, which tensor
parallelism forwards to the other ranks) and is deserialized in this thread: neither step
holds the GIL long.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import psutil

from minisgl.process import KillableChild, ignore_group_signals, leave_with_parent
from minisgl.structured.grammar import (
    CACHE_LIMIT_BYTES,
    GrammarBackend,
    GrammarError,
    GrammarKey,
    build_tokenizer_info,
    compile_with,
)
from minisgl.structured.spec import KIND_FIELDS

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 600.0  # importing xgrammar and analysing the vocabulary; slow CI machines
# The compile child takes only the CPU the model's steps leave (on a CPU server every core may
# be busy stepping): its bound counts the CPU seconds it spent, not the wall-clock time it
# waited for a core, so a busy server makes compiles slower, never wrongly refused. The wall
# clock still has a cap, for a child that cannot get a core at all.
COMPILE_NICE = 19
WALL_CAP_FACTOR = 20.0
_POLL_S = 0.05


@dataclass
class CompileOutcome:
    """A grammar's compile, done: the compiled grammar and its serialized form, or the error."""

    kind: str
    value: str
    compiled: Any = None
    serialized: str | None = None
    error: GrammarError | None = None
    evicted: list[GrammarKey] = field(default_factory=list)  # filled in by the engine
    cancelled: bool = False  # nobody wanted it any more: dropped, never handed out


class GrammarCompileService:
    """Compiles the grammars `submit` names, in order, each once while pending; `outcomes`
    hands back the finished ones. The vocabulary analysis the child makes is given to
    `backend` (`adopt_info`) and kept in `info_json` (for other ranks, and for a restarted
    child, which then skips the seconds it costs)."""

    def __init__(self, backend: GrammarBackend, timeout_s: float) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        self.info_json: str | None = None
        self._jobs: queue.Queue[GrammarKey | None] = queue.Queue()
        self._done: queue.Queue[CompileOutcome] = queue.Queue()
        self._pending: set[GrammarKey] = set()
        # Grammars whose requests all went (the client disconnected): a queued one is skipped,
        # a running one is stopped (its child killed), so that it holds no other grammar up.
        # Shared with the thread, under the lock; `_revived`: wanted again since (loop only).
        self._lock = threading.Lock()
        self._cancelled: set[GrammarKey] = set()
        self._revived: set[GrammarKey] = set()
        self._child: KillableChild | None = None
        self._setup_error: GrammarError | None = None
        self._ready = False  # the child said ready (its first message is read)
        self._thread = threading.Thread(target=self._run, name="minisgl-grammar", daemon=True)
        self._thread.start()

    def submit(self, kind: str, value: str) -> None:
        key = (kind, value)
        if key not in self._pending:
            self._pending.add(key)
            self._jobs.put(key)
            return
        with self._lock:
            # Wanted again: if not skipped yet, it compiles after all; if its cancellation is
            # on the way back already, `outcomes` queues it again.
            self._cancelled.discard(key)
            self._revived.add(key)

    def cancel(self, kind: str, value: str) -> None:
        """No request waits for this grammar any more: skip its compile if it has not
        started, stop it if it runs. `outcomes` never reports it (unless submitted again)."""
        key = (kind, value)
        if key not in self._pending:
            return
        with self._lock:
            self._revived.discard(key)
            self._cancelled.add(key)

    @property
    def busy(self) -> bool:
        return bool(self._pending)

    def outcomes(self) -> list[CompileOutcome]:
        out: list[CompileOutcome] = []
        while True:
            try:
                done = self._done.get_nowait()
            except queue.Empty:
                return out
            key = (done.kind, done.value)
            with self._lock:
                again = key in self._revived
                self._revived.discard(key)
            if done.cancelled and again:  # submitted again after it was cancelled: compile it
                self._jobs.put(key)
                continue
            self._pending.discard(key)
            if not done.cancelled:
                out.append(done)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=KillableChild.KILL_WAIT_S)
        self._stop_child()

    # ---- the thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            kind, value = job
            with self._lock:
                skip = job in self._cancelled
                self._cancelled.discard(job)
            if skip:
                logger.info("a %s grammar was dropped before its compile: nobody waits", kind)
                self._done.put(CompileOutcome(kind, value, cancelled=True))
                continue
            try:
                outcome = self._compile(kind, value)
            except Exception as exc:  # never let the thread die: the request gets the reason
                logger.exception("grammar compile failed")
                error = GrammarError(f"the grammar could not be compiled: {exc}", None)
                outcome = CompileOutcome(kind, value, error=error)
            with self._lock:
                if job in self._cancelled:  # cancelled while it ran: its result is unwanted
                    self._cancelled.discard(job)
                    outcome = CompileOutcome(kind, value, cancelled=True)
            self._done.put(outcome)
        self._stop_child()

    def _compile(self, kind: str, value: str) -> CompileOutcome:
        try:
            conn = self._ready_child()
        except GrammarError as exc:
            return CompileOutcome(kind, value, error=exc)
        conn.send((kind, value))
        answered = self._answered(conn, (kind, value))
        if answered is None:  # cancelled: stop the work, keep a child ready for the next
            logger.info("a %s grammar's compile was stopped: nobody waits for it", kind)
            self._stop_child()
            self._start_child()
            return CompileOutcome(kind, value, cancelled=True)
        if not answered:
            param = KIND_FIELDS.get(kind)
            logger.warning(
                "a %s grammar took longer than %g s to compile: stopped", kind, self.timeout_s
            )
            self._stop_child()
            self._start_child()  # the next grammar should not wait for a fresh child's start
            message = (
                f"{param or kind}: compiling its grammar took longer than {self.timeout_s:g} s "
                "of CPU time (the server's --grammar-compile-timeout); simplify it (e.g. smaller "
                "repetition bounds in patterns)"
            )
            return CompileOutcome(kind, value, error=GrammarError(message, param))
        try:
            status, payload = conn.recv()
        except (EOFError, OSError):
            self._stop_child()
            error = GrammarError("the grammar compiler died on this grammar", KIND_FIELDS.get(kind))
            return CompileOutcome(kind, value, error=error)
        if status != "ok":
            message, param = payload
            return CompileOutcome(kind, value, error=GrammarError(message, param))
        compiled = self.backend.deserialize(payload)
        return CompileOutcome(kind, value, compiled=compiled, serialized=payload)

    def _answered(self, conn: Connection, key: GrammarKey) -> bool | None:
        """Wait for the child's answer while its compile has used less than the bound in CPU
        time (and the wall clock is under its cap); False when it went over, None when the
        grammar was cancelled meanwhile."""
        assert self._child is not None and self._child.proc.pid is not None
        child = psutil.Process(self._child.proc.pid)
        start_cpu = _cpu_seconds(child)
        deadline = time.monotonic() + self.timeout_s * WALL_CAP_FACTOR
        while not conn.poll(_POLL_S):
            with self._lock:
                if key in self._cancelled:
                    return None
            used = _cpu_seconds(child) - start_cpu
            if used > self.timeout_s or time.monotonic() > deadline:
                return False
        return True

    def _ready_child(self) -> Connection:
        """The running child's pipe, starting one (and waiting for it) when there is none."""
        if self._setup_error is not None:
            raise self._setup_error
        if self._child is None or not self._child.alive():
            self._start_child()
        assert self._child is not None
        parent = self._child.conn
        if self._ready:
            return parent
        if not parent.poll(START_TIMEOUT_S):
            self._stop_child()
            raise GrammarError("the grammar compiler did not start in time", None)
        try:
            status, payload = parent.recv()
        except (EOFError, OSError):
            status, payload = "error", "the grammar compiler exited during start-up"
        if status != "ready":
            self._stop_child()
            # Most likely for good (xgrammar missing): every later request is told at once.
            self._setup_error = GrammarError(
                f"structured outputs are not available on this server: {payload}", None
            )
            raise self._setup_error
        if self.info_json is None:
            self.info_json = payload
            self.backend.adopt_info(payload)
        self._ready = True
        return parent

    def _start_child(self) -> None:
        self._stop_child()
        b = self.backend
        args = (b.model_path, b.vocab_size, b.stop_token_ids, self.info_json)
        self._child = KillableChild(_serve, args, "minisgl-grammar-compiler")

    def _stop_child(self) -> None:
        if self._child is not None:
            self._child.kill()
        self._child = None
        self._ready = False


def _cpu_seconds(proc: psutil.Process) -> float:
    try:
        times = proc.cpu_times()
    except psutil.Error:  # gone: the pipe says so next
        return 0.0
    return float(times.user + times.system)


def _serve(
    model_path: str,
    vocab_size: int,
    stop_token_ids: list[int],
    info_json: str | None,
    conn: Connection,
    parent_pid: int,
) -> None:
    """The child: set up xgrammar's compiler, say ready (with the vocabulary analysis), then
    compile until the pipe closes."""
    leave_with_parent(parent_pid)
    ignore_group_signals()  # the scheduler stops this helper (it kills it)
    os.nice(COMPILE_NICE)  # background work: the model's steps come first
    try:
        import xgrammar as xgr

        if info_json is None:
            info = build_tokenizer_info(model_path, vocab_size, stop_token_ids)
            info_json = info.serialize_json()
        else:
            info = xgr.TokenizerInfo.deserialize_json(info_json)
        # xgrammar's own cache too: the same grammar compiled again (after the scheduler's
        # cache let it go) costs nothing. Bounded, so distinct grammars cannot grow it forever.
        compiler = xgr.GrammarCompiler(
            info, max_threads=1, cache_enabled=True, cache_limit_bytes=CACHE_LIMIT_BYTES
        )
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", info_json))
    while True:
        try:
            kind, value = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        try:
            compiled = compile_with(compiler, kind, value)
        except GrammarError as exc:
            conn.send(("error", (str(exc), exc.param)))
        else:
            conn.send(("ok", compiled.serialize_json()))
