"""One log line per refused peer, without letting a peer that retries flood the log.

A stranger's ZMQ socket reconnects every 100 ms and each attempt fails the handshake again:
the first refusal of a kind is logged at once, the rest are counted and reported with the
next line after `interval_s`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class RefusalLog:
    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}  # kind -> when last logged
        self._held: dict[str, int] = {}  # kind -> refusals since, not logged

    def refused(self, kind: str, message: str) -> None:
        """Log `message` (a refusal of `kind`) unless one of that kind was logged lately."""
        now = self._clock()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self._interval_s:
                self._held[kind] = self._held.get(kind, 0) + 1
                return
            held = self._held.pop(kind, 0)
            self._last[kind] = now
        since = now - (last or now)
        more = f" (and {held} more like it in the last {since:.0f} s)" if held else ""
        self._logger.warning("%s%s", message, more)
