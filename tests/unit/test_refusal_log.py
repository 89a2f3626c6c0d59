"""A peer that keeps failing the node ports' handshake (a ZMQ socket retries every 100 ms)
gets one log line a minute with a count, not a line per attempt."""

from __future__ import annotations

import logging

import pytest

from minisgl.engine.refusals import RefusalLog


def test_repeats_are_counted_into_the_next_line(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    log = RefusalLog(logging.getLogger("refusals-test"), interval_s=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="refusals-test"):
        for _ in range(500):  # 50 s of retries
            log.refused("acks", "acks: dropped a connection")
            now[0] += 0.1
        log.refused("link", "link: dropped 10.0.0.9")  # another kind is not held back
        now[0] += 20.0
        log.refused("acks", "acks: dropped a connection")
    assert caplog.messages == [
        "acks: dropped a connection",
        "link: dropped 10.0.0.9",
        "acks: dropped a connection (and 499 more like it in the last 70 s)",
    ]
