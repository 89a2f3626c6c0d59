"""The secret a multi-node group shares, and the handshake on the nodes' link (PORT+3).

Every node holds the same secret (`--node-secret-file`, else the MINISGL_NODE_SECRET
environment variable). A peer proves it holds it without sending it: each side sends a fresh
random nonce and answers the other's with an HMAC-SHA256 over both, under its own label, so
a recorded exchange cannot be replayed and one side's proof cannot be reflected back as the
other's. ZMQ sockets get keys derived from the same secret (`curve`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket

from minisgl.config import MIN_NODE_SECRET_CHARS, NODE_SECRET_ENV, EngineArgs

_MAGIC = b"minisgl-node-link/1\n"  # tells a stray client (or a port scan) what it reached
_NONCE_BYTES = 32
_TAG_BYTES = hashlib.sha256().digest_size
_NODE_LABEL = b"node proves to node 0"
_NODE0_LABEL = b"node 0 proves to node"
HANDSHAKE_TIMEOUT_S = 5.0


class NodeAuthError(Exception):
    """A peer did not prove it holds the group's secret (or spoke something else)."""


def load_node_secret(args: EngineArgs) -> bytes:
    """The group's secret; a missing, unreadable or short one is refused in words that say
    what to do (raised before anything starts)."""
    if args.node_secret_file:
        try:
            with open(args.node_secret_file, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise ValueError(f"cannot read --node-secret-file {args.node_secret_file}: {e}") from e
        where = f"--node-secret-file {args.node_secret_file}"
    else:
        raw = os.environb.get(NODE_SECRET_ENV.encode(), b"")
        where = NODE_SECRET_ENV
    secret = raw.strip()  # a file written by `echo` ends in a newline
    if not secret and not args.node_secret_file:
        raise ValueError(
            "--nnodes > 1 needs a secret shared by every node of the group (the node ports "
            f"admit only peers that hold it): --node-secret-file PATH or {NODE_SECRET_ENV}; "
            "make one with: python -c 'import secrets; print(secrets.token_hex(32))'"
        )
    if len(secret) < MIN_NODE_SECRET_CHARS:
        raise ValueError(
            f"the node secret from {where} is {len(secret)} characters; at least "
            f"{MIN_NODE_SECRET_CHARS} are needed (e.g. secrets.token_hex(32))"
        )
    return secret


def group_secret(args: EngineArgs) -> bytes:
    """What a tensor-parallel group authenticates with: the shared secret across nodes, a
    fresh random one within one node (only its own child processes learn it)."""
    return load_node_secret(args) if args.nnodes > 1 else secrets.token_bytes(32)


def _tag(secret: bytes, label: bytes, nonce0: bytes, nonce1: bytes) -> bytes:
    return hmac.new(secret, label + nonce0 + nonce1, hashlib.sha256).digest()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        try:
            part = conn.recv(n - len(buf))
        except TimeoutError:
            raise NodeAuthError("no answer in time") from None
        if not part:
            raise NodeAuthError("closed during the handshake")
        buf += part
    return buf


def accept_handshake(conn: socket.socket, secret: bytes) -> None:
    """Node 0's side: the peer must prove it holds `secret`, then node 0 proves it too."""
    conn.settimeout(HANDSHAKE_TIMEOUT_S)
    nonce0 = secrets.token_bytes(_NONCE_BYTES)
    conn.sendall(_MAGIC + nonce0)
    answer = _recv_exact(conn, _NONCE_BYTES + _TAG_BYTES)
    nonce1, tag = answer[:_NONCE_BYTES], answer[_NONCE_BYTES:]
    if not hmac.compare_digest(tag, _tag(secret, _NODE_LABEL, nonce0, nonce1)):
        raise NodeAuthError("wrong secret")
    conn.sendall(_tag(secret, _NODE0_LABEL, nonce0, nonce1))
    conn.settimeout(None)


def connect_handshake(conn: socket.socket, secret: bytes) -> None:
    """Another node's side: answer node 0's nonce, then check node 0's proof."""
    conn.settimeout(HANDSHAKE_TIMEOUT_S)
    hello = _recv_exact(conn, len(_MAGIC) + _NONCE_BYTES)
    if not hello.startswith(_MAGIC):
        raise NodeAuthError("not a minisgl node link")
    nonce0, nonce1 = hello[len(_MAGIC) :], secrets.token_bytes(_NONCE_BYTES)
    conn.sendall(nonce1 + _tag(secret, _NODE_LABEL, nonce0, nonce1))
    try:
        proof = _recv_exact(conn, _TAG_BYTES)
    except NodeAuthError as e:
        raise NodeAuthError(f"node 0 refused this node's secret ({e})") from None
    if not hmac.compare_digest(proof, _tag(secret, _NODE0_LABEL, nonce0, nonce1)):
        raise NodeAuthError("node 0 does not hold this node's secret")
    conn.settimeout(None)
