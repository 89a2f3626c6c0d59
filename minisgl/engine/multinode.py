"""Tensor parallelism over several nodes (`--nnodes N --node-rank R --dist-init-addr HOST:PORT`).

The `--tp-size` ranks split evenly: node R runs ranks R*k .. R*k+k-1 (k = tp_size / nnodes).
Node 0 is the usual server (API, tokenizer, detokenizer, scheduler = rank 0, its local ranks);
every other node runs only its ranks and a small /health (`node_agent.run_node`). Rank 0's
broadcast and the subscriber handshake go over TCP at fixed ports next to the rendezvous port,
so every node can find them: PORT torch.distributed, PORT+1 rank 0's PUB, PORT+2 the acks,
PORT+3 the nodes' link (`NodeLink`).

Node 0 binds these ports only on the address the other nodes reach it at (the --dist-init-addr
host), and each admits only peers that prove they hold the group's secret (`node_auth` for the
link, `curve` for the ZMQ sockets); a connection that fails is logged and dropped, and never
counts as a node.

A group of nodes lives and dies as one: the link is a TCP connection from each node to node 0
carrying a beat each way. When a node dies its connection closes (or falls silent), and node 0
exits non-zero at once (its /health fails first: the launcher sees its scheduler die); when node
0 goes, every other node exits non-zero. An orchestrator then restarts the group whole.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from typing import NoReturn

from minisgl.config import EngineArgs
from minisgl.engine.node_auth import NodeAuthError, accept_handshake
from minisgl.engine.refusals import RefusalLog

logger = logging.getLogger(__name__)

BEAT_INTERVAL_S = 0.5
SILENCE_LIMIT_S = 5.0  # a peer silent this long (no close seen: a lost host) counts as dead
RESOLVE_TIMEOUT_S = 120.0  # a pod's own DNS name may appear a little after it starts
MAX_PENDING_HANDSHAKES = 16  # connections being authenticated at once; more are dropped
_BEAT = b"."


def check_args(args: EngineArgs) -> None:
    """Reject a multi-node layout that cannot work, before anything starts."""
    if args.nnodes < 1:
        raise ValueError(f"--nnodes must be >= 1, got {args.nnodes}")
    if args.tp_size % args.nnodes:
        raise ValueError(
            f"--tp-size ({args.tp_size}) must divide by --nnodes ({args.nnodes}): every node "
            "runs the same number of ranks"
        )
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank must be in [0, {args.nnodes}), got {args.node_rank}")
    if args.nnodes > 1 and args.dist_init_addr.rpartition(":")[2] in ("", "0"):
        raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT with a fixed port")


def local_ranks(args: EngineArgs) -> range:
    per_node = args.tp_size // args.nnodes
    return range(args.node_rank * per_node, (args.node_rank + 1) * per_node)


def rank_device(rank: int, args: EngineArgs, device_count: int) -> int:
    """The CUDA device (index among the visible ones) of tensor-parallel `rank`: its place
    among its node's ranks. More ranks on a node than visible GPUs would put two ranks on one
    GPU, which NCCL refuses only later ("Duplicate GPU detected"): refused here, clearly."""
    per_node = args.tp_size // args.nnodes
    if per_node > device_count:
        raise ValueError(
            f"--tp-size {args.tp_size} runs {per_node} ranks on this node but it sees "
            f"{device_count} CUDA device(s): each rank needs a GPU of its own (check "
            f"CUDA_VISIBLE_DEVICES{' and --nnodes' if args.nnodes > 1 else ''})"
        )
    return rank - args.node_rank * per_node


def bind_address(host: str) -> str:
    """The address node 0 listens on: its --dist-init-addr host, resolved (ZMQ binds only to
    addresses), so the node ports are not offered on every interface."""
    deadline = time.monotonic() + RESOLVE_TIMEOUT_S
    while True:
        try:
            return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
        except socket.gaierror as e:
            if time.monotonic() > deadline:
                raise ValueError(f"cannot resolve the --dist-init-addr host {host!r}: {e}") from e
            time.sleep(1)


class NodeLink:
    """Node 0's end: admits one authenticated connection per other node, beats to each, and
    calls `lost` (from its own thread) when any of them closes or falls silent. A connection
    that fails the handshake is logged and closed; it is never a node, so it cannot take the
    group down."""

    def __init__(
        self, host: str, port: int, num_nodes: int, secret: bytes, lost: Callable[[str], None]
    ) -> None:
        self._listener = _listen(host, port)
        self._expected = num_nodes - 1
        self._secret = secret
        self._lost = lost
        self._joined: queue.Queue[socket.socket] = queue.Queue()
        self._pending = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        self._stop = threading.Event()
        self._refusals = RefusalLog(logger)
        self._accepter = threading.Thread(
            target=self._accept, name="minisgl-nodelink-accept", daemon=True
        )
        self._thread = threading.Thread(target=self._run, name="minisgl-nodelink", daemon=True)
        self._accepter.start()
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._accepter.join(timeout=2)
        self._listener.close()

    def _accept(self) -> None:
        """Every connection gets its own handshake thread: a peer that says nothing holds
        up neither the real nodes nor the beats."""
        self._listener.settimeout(BEAT_INTERVAL_S)
        while not self._stop.is_set():
            try:
                conn, addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            if not self._pending.acquire(blocking=False):
                self._refusals.refused(
                    addr[0], f"node link: dropped {addr[0]}: too many handshakes under way"
                )
                conn.close()
                continue
            threading.Thread(target=self._authenticate, args=(conn, addr[0]), daemon=True).start()

    def _authenticate(self, conn: socket.socket, addr: str) -> None:
        try:
            accept_handshake(conn, self._secret)
        except (NodeAuthError, OSError) as e:
            self._refusals.refused(addr, f"node link: dropped {addr}: failed the handshake ({e})")
            conn.close()
            return
        finally:
            self._pending.release()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._joined.put(conn)

    def _run(self) -> None:
        peers: dict[socket.socket, float] = {}  # connection -> last time heard
        last_beat = 0.0
        while not self._stop.is_set():
            with contextlib.suppress(queue.Empty):
                conn = self._joined.get(timeout=0 if peers else BEAT_INTERVAL_S)
                if len(peers) < self._expected:
                    peers[conn] = time.monotonic()
                    logger.info(
                        "node link: %s joined (%d of %d)", _peer(conn), len(peers), self._expected
                    )
                else:
                    logger.warning("node link: dropped %s: every node has joined", _peer(conn))
                    conn.close()
            if not peers:
                continue
            now = time.monotonic()
            if now - last_beat >= BEAT_INTERVAL_S:
                last_beat = now
                for conn in peers:
                    with contextlib.suppress(OSError):
                        conn.sendall(_BEAT)
            readable, _, _ = select.select(list(peers), [], [], BEAT_INTERVAL_S / 2)
            for conn in readable:
                try:
                    data = conn.recv(64)
                except OSError:
                    data = b""
                if not data:
                    return self._lost(f"node at {_peer(conn)} closed its link")
                peers[conn] = time.monotonic()
            for conn, heard in peers.items():
                if time.monotonic() - heard > SILENCE_LIMIT_S:
                    return self._lost(f"node at {_peer(conn)} silent for {SILENCE_LIMIT_S:.0f} s")


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def _peer(conn: socket.socket) -> str:
    try:
        return str(conn.getpeername()[0])
    except OSError:
        return "?"


def exit_group(reason: str, procs: Sequence[BaseProcess]) -> NoReturn:
    """This node cannot go on without the others: stop its ranks and exit non-zero now (a
    rank may be blocked in a collective that will never complete)."""
    logger.error("multi-node group lost: %s; exiting", reason)
    for p in procs:
        with contextlib.suppress(Exception):
            p.kill()
    os._exit(1)
