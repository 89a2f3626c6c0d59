"""A per-request timeline across the service's processes, for finding dead time (debug only).

With MINISGL_TIMELINE=<file> set for the server, each process appends one line per event to
that file: `<time.time()> <pid> <rid> <stage>`. Stages in a request's order:

    received     API server: the HTTP request is parsed
    tokenized    tokenizer worker: token ids ready, sent to the scheduler
    queued       scheduler: the request is added to the engine
    scheduled    scheduler: the first step that includes it starts
    forwarded    scheduler: that step's forward pass and sampling are done (first token)
    detokenized  detokenizer: the first text is sent to the API server
    first_byte   API server: the first content chunk is handed to the HTTP response
    replied      API server: a reply that is not streamed is handed to the HTTP response
    token        API server: every later content chunk (inter-token latency)

The scheduler also writes `step_begin`/`step_end` under rid "-" around every step, so the time
outside forward passes shows. `benchmarks/serving_timeline.py` runs a server this way and prints
the gaps. Unset (the default), `mark` is one attribute test. Lines are short single writes to a
file opened for append, so processes do not interleave within a line.
"""

from __future__ import annotations

import os
import time
from typing import IO

_PATH = os.environ.get("MINISGL_TIMELINE") or None
_FILE: IO[str] | None = None

STAGES = (
    "received",
    "tokenized",
    "queued",
    "scheduled",
    "forwarded",
    "detokenized",
    "first_byte",
    "replied",
)


def enabled() -> bool:
    return _PATH is not None


def mark(rid: str, stage: str) -> None:
    global _FILE
    if _PATH is None:
        return
    if _FILE is None:
        _FILE = open(_PATH, "a", buffering=1)  # noqa: SIM115 - kept open for the process
    _FILE.write(f"{time.time():.6f} {os.getpid()} {rid} {stage}\n")


def read(path: str) -> dict[str, list[tuple[str, float]]]:
    """rid -> [(stage, time)] in time order, from a timeline file."""
    out: dict[str, list[tuple[str, float]]] = {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 4:
                out.setdefault(parts[2], []).append((parts[3], float(parts[0])))
    for events in out.values():
        events.sort(key=lambda e: e[1])
    return out
