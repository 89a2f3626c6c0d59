"""Chat templates that requests bring (`--trust-request-chat-template`) render here: in a child
process of the tokenizer worker, one render at a time, under a time bound.

Jinja's sandbox keeps a template away from Python's internals but not from the CPU: two nested
`range(100000)` loops are legal and run for hours. Rendered in the tokenizer worker, such a
template would stop every request behind it. Here the worker only hands the job over and keeps
serving; a render that outlives its bound fails its request with a 400, and the child is
killed (a thread could not be) and replaced. The model's own template never comes here: it is
the operator's code, rendered in the worker itself.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from minisgl.process import KillableChild, ignore_group_signals, leave_with_parent
from minisgl.tokenizer.chat_render import load_tokenizer, render_chat
from minisgl.tokenizer.without_torch import keep_torch_out

log = logging.getLogger("minisgl.tokenizer")

START_TIMEOUT_S = 300.0  # loading the tokenizer; a busy CI machine is slow


class RenderError(ValueError):
    """A request's template failed to render (its fault: a 400)."""


@dataclass
class RenderJob:
    key: str
    messages: Any
    kwargs: dict[str, Any]
    tools: Any
    add_generation_prompt: bool


class TemplateSandbox:
    """Renders jobs in order in a killable child; `poll()` hands back finished ones."""

    def __init__(self, model: str, timeout_s: float) -> None:
        self.model = model
        self.timeout_s = timeout_s
        self._queue: deque[RenderJob] = deque()
        self._current: RenderJob | None = None
        self._deadline = 0.0
        self._dropped: set[str] = set()
        self._child: KillableChild | None = None
        self._ready = False
        self._started_at = 0.0
        self._start()

    @property
    def busy(self) -> bool:
        return self._current is not None or bool(self._queue)

    def submit(self, job: RenderJob) -> None:
        self._queue.append(job)

    def cancel(self, key: str) -> bool:
        """Forget job `key` (its client left); False when no such job is waiting or running."""
        for job in self._queue:
            if job.key == key:
                self._queue.remove(job)
                return True
        if self._current is not None and self._current.key == key:
            self._dropped.add(key)  # let it finish or time out; nobody gets its result
            return True
        return False

    def poll(self) -> list[tuple[str, str | RenderError]]:
        """Finished jobs since the last call: (key, rendered text or the error)."""
        done: list[tuple[str, str | RenderError]] = []
        if self._current is not None:
            result = self._check_current()
            if result is not None:
                job, self._current = self._current, None
                if job.key in self._dropped:
                    self._dropped.discard(job.key)
                else:
                    done.append((job.key, result))
        if self._current is None and self._queue:
            done += self._dispatch()
        return done

    def close(self) -> None:
        self._stop_child()

    # ---- internals --------------------------------------------------------------------------
    def _start(self) -> None:
        self._child = KillableChild(_serve, (self.model,), "minisgl-template-sandbox")
        self._ready = False
        self._started_at = time.monotonic()

    def _stop_child(self) -> None:
        if self._child is not None:
            self._child.kill()
        self._child = None

    def _restart(self) -> None:
        self._stop_child()
        self._start()

    def _check_current(self) -> str | RenderError | None:
        assert self._child is not None
        conn = self._child.conn
        if conn.poll(0):
            try:
                status, value = conn.recv()
            except (EOFError, OSError):
                self._restart()
                return RenderError("the chat template renderer failed on this template")
            return value if status == "ok" else RenderError(value)
        if time.monotonic() > self._deadline:
            assert self._current is not None
            log.warning(
                "rid=%s chat template still rendering after %.1f s: stopped",
                self._current.key,
                self.timeout_s,
            )
            self._restart()
            return RenderError(f"the chat template took longer than {self.timeout_s:g} s to render")
        if not self._child.alive():  # e.g. the kernel killed it for memory
            self._restart()
            return RenderError("the chat template renderer died on this template")
        return None

    def _dispatch(self) -> list[tuple[str, str | RenderError]]:
        """Send the next job once the child is up; fail the waiting jobs if it cannot start."""
        assert self._child is not None
        conn = self._child.conn
        if not self._ready:
            if conn.poll(0):
                try:
                    conn.recv()  # "ready"
                    self._ready = True
                except (EOFError, OSError):
                    pass
            if not self._ready:
                late = time.monotonic() - self._started_at > START_TIMEOUT_S
                if not late and self._child.alive():
                    return []
                log.error("the chat template renderer did not start; restarting it")
                error = RenderError("the chat template renderer is not available")
                failed: list[tuple[str, str | RenderError]] = [(j.key, error) for j in self._queue]
                self._queue.clear()
                self._restart()
                return failed
        job = self._queue.popleft()
        try:
            conn.send(job)
        except (OSError, ValueError) as exc:  # e.g. unpicklable: cannot happen from msgpack
            self._restart()
            return [(job.key, RenderError(f"cannot send the template to the renderer: {exc}"))]
        self._current = job
        self._deadline = time.monotonic() + self.timeout_s
        return []


def _serve(model: str, conn: Connection, parent_pid: int) -> None:
    """The child: load the tokenizer, then render jobs until the pipe closes."""
    keep_torch_out()
    leave_with_parent(parent_pid)  # a template that never ends must not outlive the worker
    ignore_group_signals()  # the tokenizer worker stops this helper (it kills it)
    tokenizer = load_tokenizer(model)
    conn.send(("ready", None))
    while True:
        try:
            job: RenderJob = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        try:
            text = render_chat(
                tokenizer, job.messages, job.kwargs, job.tools, job.add_generation_prompt
            )
        except Exception as exc:  # render_chat says ValueError; anything else is the same
            conn.send(("error", str(exc)))
        else:
            conn.send(("ok", text))
