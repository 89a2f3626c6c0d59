"""`python -m minisgl`: start the workers, serve HTTP in this process, shut down cleanly.

Processes: this one (API server: FastAPI + uvicorn) plus the tokenizer, detokenizer and
scheduler workers, started with multiprocessing's spawn (no forked torch/ZMQ state). They talk
over ipc sockets in a private temporary directory that is removed at exit.

The HTTP port is bound before any worker starts (a port in use fails at once, not after the
model loaded) and the bound sockets are handed to uvicorn. SIGTERM/SIGINT are handled from the
start: during start-up they stop the workers, remove the socket directory and exit 0.

Exit codes: 0 after a signal (a drain, or a stop during start-up), 1 when the port cannot be
bound or a worker fails to start or dies.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any, cast

import uvicorn

from minisgl.config import ServerArgs, parse_server_args
from minisgl.engine.multinode import check_args
from minisgl.engine.node_auth import load_node_secret
from minisgl.engine.startup import spawn_main_problem
from minisgl.engine.worker import run_scheduler_worker
from minisgl.message.endpoints import Endpoints
from minisgl.metrics import ServerMetrics
from minisgl.models import gguf
from minisgl.process import setup_logging, stop_worker
from minisgl.server.api_server import Hooks, build_app
from minisgl.server.context import ServerContext
from minisgl.server.manager import RequestManager
from minisgl.structured.chat_template import read_chat_template, reasoning_on, tool_calls_on
from minisgl.tokenizer.detokenizer_worker import run_detokenizer_worker
from minisgl.tokenizer.tokenizer_worker import run_tokenizer_worker

log = logging.getLogger("minisgl.launcher")

STARTUP_TIMEOUT = 1800.0  # a large model's first download and load can take this long
WORKER_STOP_TIMEOUT = 5.0
LISTEN_BACKLOG = 2048  # uvicorn's default


class WorkerStartError(RuntimeError):
    pass


class _StopRequested(Exception):
    """Raised by the signal handler while start-up waits on the workers."""


def bind_listeners(host: str, port: int, backlog: int = LISTEN_BACKLOG) -> list[socket.socket]:
    """The sockets uvicorn would bind for host:port, bound and listening now. Listening, not
    only bound: with SO_REUSEADDR another process could still bind the port and listen first
    while the model loads. Same rules as asyncio's create_server, which uvicorn uses: every
    address the host resolves to (``localhost``: 127.0.0.1 and ::1), IPv6 sockets v6-only."""
    infos = socket.getaddrinfo(
        host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE
    )
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
            sock.listen(backlog)
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


class _Server(uvicorn.Server):
    """uvicorn with our signal handling: a signal starts a drain instead of closing at once."""

    def __init__(self, config: uvicorn.Config, launcher: Launcher) -> None:
        super().__init__(config)
        self.launcher = launcher

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.launcher.on_signal(sig)


class Launcher(Hooks):
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.endpoints = Endpoints.create()
        self.procs: dict[str, BaseProcess] = {}
        self.exit_code = 0
        self.stopping = False  # set once we shut workers down on purpose
        self.server: _Server | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ctx: ServerContext | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self.stop_signal: int | None = None  # a signal that came before uvicorn ran
        self._waiting_on_workers = False  # the handler may raise: nothing is half-started

    # ---- workers ----------------------------------------------------------------------------
    def tokenizer_source(self) -> str:
        """What the tokenizer workers load: the model, or a GGUF file's prepared directory
        (models/gguf.py), made first in a child process: its tokenizer is converted with torch,
        which neither this process nor the tokenizer workers load."""
        a = self.args
        if not gguf.is_gguf(a.model):
            return a.model
        try:
            ready = gguf.ready_dir(a.model)
        except (OSError, ValueError) as exc:
            raise WorkerStartError(f"cannot open GGUF file {a.model}: {exc}") from exc
        if ready is not None:
            return str(ready)
        cmd = [sys.executable, "-m", "minisgl.models.gguf", a.model, a.log_level]
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # its log: our stderr
        if done.returncode:
            raise WorkerStartError(f"cannot open GGUF file {a.model} (its error above)")
        return done.stdout.strip().splitlines()[-1]

    def start_workers(self) -> dict[str, Any]:
        spawn = mp.get_context("spawn")
        a = self.args
        tokenizer = self.tokenizer_source()
        targets: dict[str, tuple[Any, tuple[Any, ...]]] = {
            "tokenizer": (
                run_tokenizer_worker,
                (
                    tokenizer,
                    self.endpoints,
                    a.chat_template_timeout if a.trust_request_chat_template else None,
                ),
            ),
            "detokenizer": (run_detokenizer_worker, (tokenizer, self.endpoints)),
            "scheduler": (run_scheduler_worker, (a.engine_args(), self.endpoints)),
        }
        pipes: dict[Connection, str] = {}
        for name, (target, head) in targets.items():
            self._raise_if_stopped()
            reader, writer = spawn.Pipe(duplex=False)
            proc = spawn.Process(
                target=target, args=(*head, writer, a.log_level), name=f"minisgl-{name}"
            )
            proc.start()
            writer.close()
            self.procs[name] = proc
            pipes[reader] = name
            log.info("started %s worker (pid %d)", name, proc.pid)
        self._waiting_on_workers = True
        try:
            return self._wait_for_workers(pipes)
        finally:
            self._waiting_on_workers = False

    def _wait_for_workers(self, pipes: dict[Connection, str]) -> dict[str, Any]:
        self._raise_if_stopped()
        start = time.monotonic()
        infos: dict[str, Any] = {}
        sentinels = {p.sentinel: n for n, p in self.procs.items()}
        while pipes:
            left = STARTUP_TIMEOUT - (time.monotonic() - start)
            if left <= 0:
                raise WorkerStartError(
                    f"workers not ready in {STARTUP_TIMEOUT:.0f} s: {list(pipes.values())}"
                )
            for ready in wait([*pipes, *sentinels], timeout=min(left, 1.0)):
                if isinstance(ready, int):  # a process sentinel: some worker exited
                    name = sentinels[ready]
                    pending = [c for c, n in pipes.items() if n == name]
                    if pending and not pending[0].poll():  # ...before saying why
                        self.procs[name].join(1.0)  # its exit code, not None
                        code = self.procs[name].exitcode
                        why = spawn_main_problem()
                        raise WorkerStartError(
                            f"{name} worker exited during start-up (code {code})"
                            + (f": {why}" if why else "")
                        )
                    continue
                conn = cast(Connection, ready)
                name = pipes.pop(conn)
                try:
                    info: dict[str, Any] = conn.recv()
                except EOFError:
                    raise WorkerStartError(f"{name} worker exited during start-up") from None
                if not info.get("ok"):
                    raise WorkerStartError(f"{name} worker failed to start: {info.get('error')}")
                infos[name] = info
                log.info("%s worker ready (%.1f s)", name, time.monotonic() - start)
        return infos

    def dead_worker(self) -> str | None:
        if self.stopping:
            return None
        for name, proc in self.procs.items():
            if not proc.is_alive():
                return f"{name} worker (pid {proc.pid}) died with exit code {proc.exitcode}"
        return None

    def stop_workers(self) -> None:
        self.stopping = True
        for proc in self.procs.values():
            if proc.is_alive():
                stop_worker(proc)  # the worker loop exits at its next poll
        deadline = time.monotonic() + WORKER_STOP_TIMEOUT
        for name, proc in self.procs.items():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                log.warning("%s worker did not stop in time; killing it", name)
                proc.kill()
                proc.join(2.0)

    # ---- hooks for the app ------------------------------------------------------------------
    def listening(self) -> bool:
        return bool(self.server and self.server.started)

    def on_ready(self) -> None:
        a = self.args
        log.info("ready: serving %s at http://%s:%d", a.model_name, a.host, a.port)

    def exit(self, code: int) -> None:
        self.exit_code = code
        if self.server is not None:
            # No force_exit: in-flight requests were already failed, so the graceful path is
            # quick (bounded by timeout_graceful_shutdown) and the lifespan closes cleanly.
            self.server.should_exit = True

    # ---- signals and drain ------------------------------------------------------------------
    def on_startup_signal(self, sig: int, frame: FrameType | None) -> None:
        """SIGTERM/SIGINT outside uvicorn's serve(): before it (start-up) and after it."""
        name = signal.Signals(sig).name
        if self.stopping or (self.loop is not None and self.loop.is_closed()):
            log.info("%s received: already stopping", name)
            return
        if self.loop is not None and self.server is not None:
            self.on_signal(sig)  # between our check in _serve and uvicorn's own handler
            return
        if self.stop_signal is None:
            log.info("%s received during start-up: stopping the workers", name)
        self.stop_signal = sig
        if self._waiting_on_workers:
            raise _StopRequested

    def _raise_if_stopped(self) -> None:
        if self.stop_signal is not None:
            raise _StopRequested

    def on_signal(self, sig: int) -> None:
        # Runs in the main thread between bytecodes: hand over to the event loop.
        if self.loop is None or self.server is None:
            return
        if self._drain_task is not None:
            log.warning("second %s: exiting without waiting", signal.Signals(sig).name)
            self.server.should_exit = True
            self.server.force_exit = True
            return
        log.info("%s received: draining", signal.Signals(sig).name)
        self.loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        assert self.ctx is not None and self.server is not None
        ctx = self.ctx
        ctx.draining = True
        manager = ctx.manager
        timeout = self.args.shutdown_timeout
        log.info("draining %d in-flight requests (up to %.0f s)", len(manager.requests), timeout)
        deadline = time.monotonic() + timeout
        while manager.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if manager.requests:
            log.warning("drain timeout: aborting %d requests", len(manager.requests))
            manager.fail_all("the server shut down before the request finished", 503)
            await asyncio.sleep(0.1)  # let handlers send their replies
            for rid in list(manager.requests):
                manager.abort(rid)
        log.info("drained; stopping")
        self.server.should_exit = True

    # ---- run --------------------------------------------------------------------------------
    def run(self) -> int:
        a = self.args
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.on_startup_signal)
        try:
            listeners = bind_listeners(a.host, a.port)
        except OSError as exc:
            self.endpoints.remove()
            log.error("cannot listen on %s port %d: %s", a.host, a.port, exc.strerror or exc)
            return 1
        log.info("starting: model %s, ipc dir %s", a.model, self.endpoints.root)
        try:
            infos = self.start_workers()
            sched = infos["scheduler"]
            metrics = ServerMetrics(a.model_name)
            metrics.set_model(
                sched.get("quantization", "none"),
                sched.get("dtype", ""),
                sched.get("weight_bytes", 0),
                lm_head=sched.get("lm_head", "none"),
                activations=sched.get("activations", "exact"),
                kv_cache=sched.get("kv_cache", ""),
            )
            manager = RequestManager(self.endpoints, metrics)
            self.ctx = ServerContext(
                args=a,
                manager=manager,
                metrics=manager.metrics,
                max_seq_len=sched.get("max_seq_len"),
                vocab_size=sched.get("vocab_size"),
                worker_pids={n: p.pid or 0 for n, p in self.procs.items()},
                ipc_dir=self.endpoints.root,
            )
            template = read_chat_template(sched.get("model_path") or a.model)
            self.ctx.prefilled_think = dict(infos["tokenizer"].get("prefilled_think") or {})
            self.ctx.reasoning_parser = reasoning_on(a.reasoning_parser, template) or (
                # Qwen3's Thinking-2507 template always thinks: no enable_thinking switch.
                a.reasoning_parser == "auto" and any(self.ctx.prefilled_think.values())
            )
            self.ctx.tool_call_parser = tool_calls_on(a.tool_call_parser, template)
            self.ctx.special_tags = tuple(infos["detokenizer"].get("special_tags") or ())
            app = build_app(self.ctx, self)
            config = uvicorn.Config(
                app,
                host=a.host,
                port=a.port,
                log_config=None,
                access_log=False,
                timeout_graceful_shutdown=5,
                timeout_keep_alive=5,
            )
            self._raise_if_stopped()
            self.server = _Server(config, self)
            asyncio.run(self._serve(listeners))
            self._raise_if_stopped()
            if not self.server.started and self.exit_code == 0:
                self.exit_code = 1  # e.g. the app's lifespan failed
        except _StopRequested:
            log.info("stopped during start-up")
            self.exit_code = 0
        except WorkerStartError as exc:
            log.error("%s", exc)
            self.exit_code = 1
        except SystemExit as exc:  # uvicorn exits this way when it cannot bind
            self.exit_code = exc.code if isinstance(exc.code, int) and exc.code else 1
        finally:
            t0 = time.monotonic()
            for sock in listeners:
                sock.close()
            self.stop_workers()
            self.endpoints.remove()
            log.info(
                "workers stopped in %.1f s; removed %s", time.monotonic() - t0, self.endpoints.root
            )
        log.info("exited with code %d", self.exit_code)
        return self.exit_code

    async def _serve(self, listeners: list[socket.socket]) -> None:
        assert self.server is not None
        self.loop = asyncio.get_running_loop()
        if self.stop_signal is not None:
            return  # came just before the loop existed: the handler could only note it
        await self.server.serve(sockets=listeners)


def main(argv: list[str] | None = None) -> None:
    args = parse_server_args(argv)
    try:
        check_args(args)
        if args.nnodes > 1:
            load_node_secret(args)  # every node needs it: refuse before anything starts
    except ValueError as e:
        sys.exit(f"python -m minisgl: error: {e}")
    setup_logging(args.log_level, "launcher")
    if args.node_rank > 0:
        # Not node 0: only this node's tensor-parallel ranks and a /health. (Imported here:
        # it needs torch, which the API server process never loads.)
        from minisgl.engine.node_agent import run_node

        sys.exit(run_node(args))
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).setLevel(logging.WARNING)
    sys.exit(Launcher(args).run())
