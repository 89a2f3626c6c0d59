"""How many prompt tokens one step should prefill when a burst of requests waits (torch-free).

A burst prefilled in one step gives every request of it its first token at the end of that one
long step. Prefilled a few requests per step, in arrival order, the first ones get theirs after
the first short step, and the decodes of the requests already prefilled ride along in the later
steps. What that costs is the fixed part of every extra step: a step of n tokens takes about
T(n) = a + b*n (a: reading the weights and the per-step work; b: a token's arithmetic), so a
chunk of n tokens pays a / (b*n) on top of its arithmetic. The chunk is sized so that this stays
at most OVERHEAD: n >= a / (OVERHEAD * b). On a CPU whose prefill is compute-bound from a few
hundred rows, a is small next to the arithmetic and the chunks are small; where a step's fixed
cost is large (a GPU's launch, a slow weight read) they are large, up to max_prefill_tokens.
OVERHEAD is the default of `--prefill-chunk-overhead`.

The line is fitted by least squares over the engine's own prefill steps (their tokens, decodes
included, against their seconds) with exponential forgetting, so it follows the machine and its
load. While the steps seen do not spread enough to tell a from b, the decode steps' time stands
in for a (a pessimistic choice: it makes chunks larger, never smaller), and with no prefill step
timed yet there is no soft budget: the hard max_prefill_tokens alone applies.
"""

from __future__ import annotations

import math

# The share of a chunk's time its step's fixed cost may take: 0.1 keeps a burst's prefill within
# 1.1x of one big step's in the worst case (a line). Replaying the scheduler on the step costs
# measured on a quiet 2-core Xeon (Sapphire Rapids, AMX; decode B=1 52 ms, B=32 84 ms, 512-token
# prefill 402 ms, 3840 tokens 2565 ms): 32 x 128-token prompts, 64 tokens out, TTFT mean 0.69x
# and median 0.58x of one step's, output throughput 0.97x; 0.25 gave 0.69x, 0.73x and 0.94x.
OVERHEAD = 0.1
# Each new timing weighs 1; older ones decay by this per timing (~20 timings).
FORGET = 0.95
# The fit is trusted only when the timed sizes spread by at least this fraction of their mean.
MIN_SPREAD = 0.25
# Decode steps up to this many rows time the fixed cost (the weights' read) when the prefill
# steps cannot tell it apart.
SMALL_DECODE_ROWS = 8


class PrefillBudget:
    """The soft per-step prefill budget, learned from step timings."""

    def __init__(self, max_tokens: int, min_tokens: int = 1, overhead: float = OVERHEAD) -> None:
        if overhead <= 0:
            raise ValueError(f"the overhead must be > 0, got {overhead}")
        self.max_tokens = max_tokens
        self.overhead = overhead
        self.min_tokens = max(1, min(min_tokens, max_tokens))
        self._s = [0.0] * 5  # decayed sums: weight, x, y, x^2, x*y over prefill steps
        self._decode_s = 0.0  # decayed mean of small decode steps' seconds
        self._decode_w = 0.0

    def observe(self, prefill_tokens: int, decode_rows: int, seconds: float) -> None:
        """One step's timing: prompt tokens it prefilled, decode rows beside them, seconds."""
        if seconds <= 0 or not math.isfinite(seconds):
            return
        if prefill_tokens == 0:
            if 0 < decode_rows <= SMALL_DECODE_ROWS:
                self._decode_s = self._decode_s * FORGET + seconds
                self._decode_w = self._decode_w * FORGET + 1.0
            return
        x = float(prefill_tokens + decode_rows)
        s = self._s
        for i, v in enumerate((1.0, x, seconds, x * x, x * seconds)):
            s[i] = s[i] * FORGET + v

    def line(self) -> tuple[float, float] | None:
        """(a, b) of T(n) = a + b*n, or None before anything can be told."""
        w, sx, sy, sxx, sxy = self._s
        if w <= 0:
            return None
        mx, my = sx / w, sy / w
        var = sxx / w - mx * mx
        if var > (MIN_SPREAD * mx) ** 2:
            b = (sxy / w - mx * my) / var
            a = my - b * mx
            if b > 0 and a >= 0:
                return a, b
        if self._decode_w <= 0:
            return None
        a = min(self._decode_s / self._decode_w, my)  # the weights' read, at most a whole step
        b = (my - a) / mx
        return (a, b) if b > 0 else None

    def tokens(self) -> int | None:
        """The soft budget: the smallest chunk whose fixed cost stays within the overhead,
        or None (no soft budget) while the costs are unknown."""
        fit = self.line()
        if fit is None:
            return None
        a, b = fit
        # (less a hair: a fit's rounding must not turn 1000.0000001 into 1001)
        n = math.ceil(a / (self.overhead * b) - 1e-6) if a > 0 else self.min_tokens
        return max(self.min_tokens, min(self.max_tokens, n))
