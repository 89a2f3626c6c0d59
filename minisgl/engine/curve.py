"""ZMQ CURVE for the tensor-parallel sockets, with keys derived from the group's secret.

Rank 0's PUB (steps, prompts included) and PULL (acks, stats) are CURVE servers; every
follower is a CURVE client. A peer without the secret cannot complete the handshake, so a
stranger's SUB receives nothing and a stranger's PUSH delivers nothing, and what crosses the
wire is encrypted. Both key pairs come from the secret; on top, a ZAP handler admits only the
client key the secret yields (the server key alone, were it ever seen, is not enough).
`PortGuard` logs each refused connection.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import threading

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from minisgl.engine.refusals import RefusalLog

logger = logging.getLogger(__name__)

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP spec (RFC 27)
_ZAP_DOMAIN = "minisgl-tp"
_REFUSED_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL


def _key_pair(secret: bytes, role: bytes) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys; any 32 bytes are a Curve25519 secret key."""
    private = z85.encode(hmac.new(secret, b"minisgl curve " + role, hashlib.sha256).digest())
    return zmq.curve_public(private), private


def server_key(secret: bytes) -> bytes:
    """Rank 0's public key (Z85) for the group holding `secret`."""
    return _key_pair(secret, b"server")[0]


def serve(sock: zmq.Socket, secret: bytes) -> None:
    """Make `sock` (before bind) a CURVE server for the group."""
    public, private = _key_pair(secret, b"server")
    sock.curve_server = True
    sock.curve_publickey = public
    sock.curve_secretkey = private
    sock.zap_domain = _ZAP_DOMAIN.encode()


def connect_as_client(sock: zmq.Socket, secret: bytes) -> None:
    """Make `sock` (before connect) a CURVE client of the group's rank 0."""
    public, private = _key_pair(secret, b"client")
    sock.curve_serverkey = server_key(secret)
    sock.curve_publickey = public
    sock.curve_secretkey = private


class PortGuard:
    """One thread that answers ZAP requests (only the group's client key passes) and logs
    every connection a guarded socket drops for failing the handshake."""

    def __init__(self, ctx: zmq.Context, secret: bytes) -> None:
        self._client_key = z85.decode(_key_pair(secret, b"client")[0])
        self._zap = ctx.socket(zmq.REP)
        self._zap.linger = 0
        self._zap.bind(_ZAP_ENDPOINT)
        self._monitors: dict[zmq.Socket, tuple[zmq.Socket, str]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._log = RefusalLog(logger)

    def watch(self, sock: zmq.Socket, name: str) -> None:
        """Log `sock`'s refused connections as `name` (call before `start`)."""
        monitor = sock.get_monitor_socket(_REFUSED_EVENTS)
        self._monitors[monitor] = (sock, name)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="minisgl-tp-guard", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Before the guarded sockets close (their monitors go first)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for monitor, (sock, _) in self._monitors.items():
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            monitor.close(0)
        self._zap.close(0)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        for monitor in self._monitors:
            poller.register(monitor, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(200):
                if sock is self._zap:
                    self._answer(self._zap.recv_multipart())
                else:
                    event = parse_monitor_message(sock.recv_multipart())
                    name = self._monitors[sock][1]
                    self._log.refused(
                        name,
                        f"{name}: dropped a connection that failed the handshake (no or wrong "
                        f"node secret, or not a minisgl peer): {zmq.Event(event['event']).name}",
                    )

    def _answer(self, request: list[bytes]) -> None:
        # version, request id, domain, address, identity, mechanism, credentials...
        if len(request) < 2:
            return  # nothing to answer to; libzmq never sends this
        version, request_id = request[0], request[1]
        address = request[3].decode(errors="replace") if len(request) > 3 else "?"
        ok = (
            len(request) == 7
            and request[5] == b"CURVE"
            and hmac.compare_digest(request[6], self._client_key)
        )
        if not ok:
            self._log.refused(
                f"zap {address}", f"tensor-parallel port: refused {address}: not the group's key"
            )
        status = (b"200", b"OK") if ok else (b"400", b"not the group's key")
        self._zap.send_multipart([version, request_id, *status, b"", b""])
