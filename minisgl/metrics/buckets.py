"""Histogram bucket boundaries shared by the server metrics and the dashboards.

They have to fit a CPU box (hundreds of ms per token) and a GPU (a few ms per token) alike,
so they are roughly log-spaced from 1 ms upward.
"""

# Time to first token: 1 ms (GPU, cached prefix) up to minutes (long prompt on CPU, queued).
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4,
    0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 90.0, 120.0,
    240.0, 480.0,
)  # fmt: skip

# Per-token latencies (TPOT and inter-token latency): 1 ms .. 10 s.
TOKEN_LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip

# Whole-request latency and queueing: 1 ms .. 30 min.
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0, 1200.0, 1800.0,
)  # fmt: skip

# Requests per forward step, 1 .. 512 (the largest batch a single replica is expected to run).
BATCH_SIZE_BUCKETS: tuple[float, ...] = (
    1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512,
)  # fmt: skip

# Speculative decoding: draft tokens one request kept in one verify step, 0 .. the largest
# --speculative-num-draft-tokens worth serving (le="0": verifies that kept nothing).
ACCEPT_LENGTH_BUCKETS: tuple[float, ...] = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32)
