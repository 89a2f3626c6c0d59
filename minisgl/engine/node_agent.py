"""A node other than 0 of a multi-node group (`--node-rank R` > 0): this node's tensor-parallel
ranks, a small /health for probes, and its link to node 0 (see `multinode`)."""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import logging
import multiprocessing as mp
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess

from minisgl.config import ServerArgs
from minisgl.engine.multinode import BEAT_INTERVAL_S, SILENCE_LIMIT_S, exit_group, local_ranks
from minisgl.engine.node_auth import NodeAuthError, connect_handshake
from minisgl.engine.tp_engine import Rendezvous, follower_main
from minisgl.process import stop_worker

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 1800.0  # nodes start in any order and load weights first
_BEAT = b"."


class _Health(http.server.BaseHTTPRequestHandler):
    healthy: Callable[[], bool] = staticmethod(lambda: False)

    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        if self.path.split("?")[0] != "/health":
            self.send_error(404)
            return
        ok = type(self).healthy()
        body = b"ok\n" if ok else b"not ready\n"
        self.send_response(200 if ok else 503)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        return  # probes every few seconds: not worth a log line


def _connect(host: str, port: int, deadline: float, stopping: threading.Event) -> socket.socket:
    """Node 0 may start later (or still be loading): retry until the deadline, or until this
    node is asked to stop."""
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=5)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return conn
        except OSError:
            if time.monotonic() > deadline or stopping.is_set():
                raise
            time.sleep(1)


def run_node(args: ServerArgs) -> int:
    """A node other than 0: its ranks, a /health for probes, and the link to node 0."""
    rdv = Rendezvous.for_args(args)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    spawn = mp.get_context("spawn")
    engine_args = dataclasses.asdict(args.engine_args())
    procs: list[BaseProcess] = [
        spawn.Process(
            target=follower_main,
            args=(engine_args, rank, dataclasses.asdict(rdv), os.getpid()),
            name=f"minisgl-tp{rank}",
            daemon=True,
        )
        for rank in local_ranks(args)
    ]
    for p in procs:
        p.start()
    linked = threading.Event()
    _Health.healthy = staticmethod(
        lambda: linked.is_set() and not stopping.is_set() and all(p.is_alive() for p in procs)
    )
    health = http.server.ThreadingHTTPServer((args.host, args.port), _Health)
    threading.Thread(target=health.serve_forever, name="minisgl-health", daemon=True).start()
    logger.info(
        "node %d of %d: ranks %s, /health on %s:%d",
        args.node_rank,
        args.nnodes,
        list(local_ranks(args)),
        args.host,
        args.port,
    )
    try:
        conn = _connect(rdv.host, rdv.link_port, time.monotonic() + CONNECT_TIMEOUT_S, stopping)
    except OSError as e:
        if stopping.is_set():
            exit_group("stopped before node 0 was reached", procs)
        exit_group(f"cannot reach node 0 at {rdv.host}:{rdv.link_port}: {e}", procs)
    try:
        connect_handshake(conn, bytes.fromhex(rdv.secret))
    except (NodeAuthError, OSError) as e:
        exit_group(
            f"node link to {rdv.host}:{rdv.link_port}: {e}; every node of a group needs the "
            "same secret (--node-secret-file or MINISGL_NODE_SECRET)",
            procs,
        )
    linked.set()
    heard = last_beat = time.monotonic()
    while not stopping.is_set():
        dead = [p.name for p in procs if not p.is_alive()]
        if dead:
            exit_group(f"local rank(s) exited: {', '.join(dead)}", procs)
        now = time.monotonic()
        if now - last_beat >= BEAT_INTERVAL_S:
            last_beat = now
            with contextlib.suppress(OSError):
                conn.sendall(_BEAT)
        readable, _, _ = select.select([conn], [], [], BEAT_INTERVAL_S / 2)
        if readable:
            try:
                data = conn.recv(64)
            except OSError:
                data = b""
            if not data:
                exit_group("node 0 closed the link", procs)
            heard = time.monotonic()
        elif time.monotonic() - heard > SILENCE_LIMIT_S:
            exit_group(f"node 0 silent for {SILENCE_LIMIT_S:.0f} s", procs)
    # Asked to stop (the pod is terminating): the group is going anyway.
    logger.info("node %d: stopping", args.node_rank)
    for p in procs:
        stop_worker(p)  # the ranks leave SIGTERM to this agent (ignore_group_signals)
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    health.shutdown()
    conn.close()
    return 0
