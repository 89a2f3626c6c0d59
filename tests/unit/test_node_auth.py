"""The node link's handshake (node_auth) over a real socket pair: both sides prove the shared
secret without sending it; a wrong secret, a silent peer or another protocol is refused."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from minisgl.config import EngineArgs
from minisgl.engine import node_auth
from minisgl.engine.node_auth import NodeAuthError, accept_handshake, connect_handshake

SECRET = b"0123456789abcdef-shared"


def handshake(node0_secret: bytes, node_secret: bytes) -> tuple[object, object]:
    """Run both sides; each side's outcome: None (passed) or the error it raised."""
    a, b = socket.socketpair()
    out: dict[str, object] = {}

    def side(name: str, fn, conn: socket.socket, secret: bytes) -> None:  # noqa: ANN001
        try:
            fn(conn, secret)
            out[name] = None
        except NodeAuthError as e:
            out[name] = e
            conn.close()  # as NodeLink does: the other side sees the refusal at once

    t = threading.Thread(target=side, args=("node0", accept_handshake, a, node0_secret))
    t.start()
    side("node", connect_handshake, b, node_secret)
    t.join(timeout=30)
    a.close()
    b.close()
    return out["node0"], out["node"]


def test_the_same_secret_passes_both_ways() -> None:
    assert handshake(SECRET, SECRET) == (None, None)


def test_a_wrong_secret_fails_on_both_sides() -> None:
    node0, node = handshake(SECRET, b"another-secret-of-16+")
    assert isinstance(node0, NodeAuthError) and "wrong secret" in str(node0)
    assert isinstance(node, NodeAuthError) and "refused" in str(node)


def test_a_silent_peer_or_another_protocol_is_refused(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(node_auth, "HANDSHAKE_TIMEOUT_S", 0.2)
    a, b = socket.socketpair()
    with a, b, pytest.raises(NodeAuthError, match="no answer in time"):
        accept_handshake(a, SECRET)  # b never answers
    a, b = socket.socketpair()
    with a, b:
        b.sendall(b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 64)
        with pytest.raises(NodeAuthError, match="not a minisgl node link"):
            connect_handshake(a, SECRET)


def test_the_secret_comes_from_the_file_else_the_environment(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    args = EngineArgs(model="m", nnodes=2, dist_init_addr="h:29500")
    monkeypatch.delenv("MINISGL_NODE_SECRET", raising=False)
    with pytest.raises(ValueError, match="--node-secret-file PATH or MINISGL_NODE_SECRET"):
        node_auth.load_node_secret(args)
    monkeypatch.setenv("MINISGL_NODE_SECRET", "from-the-environment")
    assert node_auth.load_node_secret(args) == b"from-the-environment"
    path = tmp_path / "secret"
    path.write_text("  from-the-file-0123\n")
    with_file = EngineArgs(model="m", nnodes=2, node_secret_file=str(path))
    assert node_auth.load_node_secret(with_file) == b"from-the-file-0123"  # the file wins
    path.write_text("short\n")
    with pytest.raises(ValueError, match="is 5 characters; at least 16"):
        node_auth.load_node_secret(with_file)
