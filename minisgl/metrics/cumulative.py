"""Turns cumulative totals reported by another process into counter increments."""

import threading


class CumulativeDeltas:
    """Remembers the last total seen per key and returns what was added since.

    The scheduler reports running totals (it knows nothing about Prometheus); a Prometheus
    counter only goes up, so each update is converted into an increment. Totals start at 0
    when the scheduler starts, so the first report counts in full. A total that goes down means
    the reporting process restarted from 0: the new total is then the increment.
    """

    def __init__(self) -> None:
        self._last: dict[str, int] = {}
        self._lock = threading.Lock()

    def delta(self, key: str, total: int) -> int:
        total = int(total)
        if total < 0:
            raise ValueError(f"cumulative total {key}={total} is negative")
        with self._lock:
            last = self._last.get(key)
            self._last[key] = total
        if last is None or total < last:
            return total
        return total - last
