"""Which CPU matmul runs for which layer shape and row count: the bookkeeping, torch-free.

What is fastest differs from one CPU to the next (AVX2 vs AVX-512 vs AMX, MKL vs oneDNN vs our
kernels, bandwidth vs FLOPs), so nothing here is a tuned constant: cpu_linear.py times the
candidates on the running machine and this module
- splits row counts into buckets (1, 2-4, 5-8, 9-16, 17-64, >64) and names the row count timed
  for each;
- picks the fastest candidate per bucket from measured (or, in tests, injected) timings;
- keys the results by what decides them (CPU model and flags, torch version, threads, the
  kernels' build) and keeps them in a JSON file in the cache directory, so a restart does not
  re-tune, and a different machine, torch or kernel build never reads another's picks;
- says in one line what was picked.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# (first, last) rows of each bucket; None: no upper end.
BUCKETS: tuple[tuple[int, int | None], ...] = (
    (1, 1),
    (2, 4),
    (5, 8),
    (9, 16),
    (17, 64),
    (65, None),
)
BUCKET_NAMES = tuple(f"{a}" if a == b else (f"{a}-{b}" if b else f">{a - 1}") for a, b in BUCKETS)
# The row count timed for each bucket: its top (the costliest case a bucket's pick must serve),
# and for the open bucket a prefill-sized chunk.
TIMED_ROWS = (1, 4, 8, 16, 64, 256)
MODES = ("cached", "full", "off")
# Rows above which every bucket lookup is the last bucket's.
_TABLE_ROWS = 65


def bucket_of(rows: int) -> int:
    """Index into BUCKETS of a row count (0 rows count as 1)."""
    for i, (_, last) in enumerate(BUCKETS):
        if last is None or rows <= last:
            return i
    raise AssertionError("the last bucket is open")


def row_table(picks: Sequence[str]) -> list[str]:
    """picks per bucket -> the pick for each row count 0.._TABLE_ROWS (the last entry serves all
    larger counts): a list index at call time instead of a search."""
    return [picks[bucket_of(max(r, 1))] for r in range(_TABLE_ROWS + 1)]


def table_index(rows: int) -> int:
    return rows if rows < _TABLE_ROWS else _TABLE_ROWS


# A later candidate must beat the earlier best by this fraction to be picked: timings on a
# shared machine jitter by a few percent, and the later candidates (oneDNN) cost a weight copy.
MARGIN = 0.05


def pick(
    timings: Mapping[str, Sequence[float | None]], prefer: Sequence[str] | None = None
) -> tuple[str, ...]:
    """The fastest candidate per bucket. `timings[name][b]`: seconds for bucket b, None where the
    candidate cannot run (or was abandoned as hopeless). The incumbent is `prefer[b]` if given
    (the untimed default), else the first candidate in `timings`' order (list the ones that
    need no extra weight copy first); another must be more than MARGIN faster to replace it."""
    out = []
    for b in range(len(BUCKETS)):
        order = list(timings)
        if prefer is not None and prefer[b] in timings:
            order.remove(prefer[b])
            order.insert(0, prefer[b])
        best: tuple[float, str] | None = None
        for name in order:
            t = timings[name][b]
            if t is not None and (best is None or t < best[0] * (1 - MARGIN)):
                best = (t, name)
        if best is None:
            raise ValueError(f"no candidate ran for rows {BUCKET_NAMES[b]}")
        out.append(best[1])
    return tuple(out)


# What a second copy of a layer's weights must save to be kept: twice the memory for less is a
# poor trade, and single buckets of a shared machine's timings jitter by more than the few
# percent MARGIN allows for, so the average over the buckets decides, with a cap for one bucket.
COPY_WORTH = 0.10
COPY_WORTH_ONE_BUCKET = 0.25


def policy(candidates: Sequence[str]) -> str:
    """The rules picks are made by, for the cache key: a change to them re-measures."""
    return f"{','.join(candidates)};margin={MARGIN};copy={COPY_WORTH}/{COPY_WORTH_ONE_BUCKET}"


def one_layout(
    picks: Sequence[str], timings: Mapping[str, Sequence[float | None]], alone: str
) -> tuple[str, ...]:
    """Every bucket on `alone` (a candidate that computes from its own copy of the weight, so
    the original can be dropped) where `picks` use it somewhere and the others' picks are not
    worth keeping the original for: on average over the buckets at most COPY_WORTH faster than
    `alone`, and nowhere more than COPY_WORTH_ONE_BUCKET. Otherwise `picks` as they are (both
    copies kept)."""
    times = timings.get(alone)
    if alone not in picks or times is None:
        return tuple(picks)
    ratios = []
    for b, name in enumerate(picks):
        t, best = times[b], timings[name][b]
        if t is None or best is None:
            return tuple(picks)
        ratios.append(t / best if best > 0 else 1.0)
    if sum(ratios) / len(ratios) > 1 + COPY_WORTH or max(ratios) > 1 + COPY_WORTH_ONE_BUCKET:
        return tuple(picks)
    return tuple(alone for _ in picks)


def disturbed(spreads: Sequence[float], limit: float = 1.5) -> bool:
    """Whether timings were taken while other work held the cores: `spreads` are each
    candidate's slowest pass over its fastest; on a quiet machine they stay near 1. Picks from
    a disturbed run are used but not cached, so a later start measures again."""
    ordered = sorted(spreads)
    return bool(ordered) and ordered[len(ordered) // 2] > limit


def forced(name: str, available: Sequence[str], default: Sequence[str]) -> tuple[str, ...]:
    """Every bucket on candidate `name` where it can run here, else the default's pick."""
    if name not in available:
        return tuple(default)
    return tuple(name for _ in BUCKETS)


@dataclass(frozen=True)
class ShapeKey:
    """What a matmul's timing depends on besides the machine: weight [n, k], dtypes."""

    n: int
    k: int
    weight_dtype: str
    x_dtype: str
    out_dtype: str

    def __str__(self) -> str:
        return f"{self.n}x{self.k}:{self.weight_dtype}:{self.x_dtype}->{self.out_dtype}"


@dataclass(frozen=True)
class MachineKey:
    """What makes picks from one run valid for another: the machine and software the timings
    came from, and the rules that turned timings into picks."""

    cpu_model: str
    cpu_flags: str  # sorted, space-separated
    torch_version: str
    threads: int
    kernels: str  # the C kernels' build ("avx512-<digest>") or "none"
    policy: str = ""  # the candidates and margins (policy()): new rules re-measure

    @staticmethod
    def of(
        cpu_model: str,
        flags: frozenset[str],
        torch_version: str,
        threads: int,
        kernels: str,
        policy: str = "",
    ) -> MachineKey:
        flat = " ".join(sorted(flags))
        return MachineKey(cpu_model, flat, torch_version, threads, kernels, policy)

    def as_dict(self) -> dict[str, str | int]:
        return {
            "cpu_model": self.cpu_model,
            "cpu_flags": self.cpu_flags,
            "torch_version": self.torch_version,
            "threads": self.threads,
            "kernels": self.kernels,
            "policy": self.policy,
        }

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:16]


class TuningCache:
    """Picks per shape for one MachineKey, in `root`/cpu-linear-<digest>.json. A file whose
    stored key differs from ours (a hash collision, a hand edit) is ignored, as is a pick naming
    a candidate that does not exist here any more."""

    def __init__(self, root: Path, key: MachineKey) -> None:
        self.key = key
        self.path = Path(root) / f"cpu-linear-{key.digest()}.json"

    def load(self) -> dict[str, tuple[str, ...]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("key") != self.key.as_dict():
            return {}
        picks = data.get("picks")
        if not isinstance(picks, dict):
            return {}
        return {
            k: tuple(v)
            for k, v in picks.items()
            if isinstance(v, list) and len(v) == len(BUCKETS) and all(isinstance(s, str) for s in v)
        }

    def get(self, shape: ShapeKey, available: Sequence[str]) -> tuple[str, ...] | None:
        got = self.load().get(str(shape))
        if got is None or any(name not in available for name in got):
            return None
        return got

    def put(self, entries: Mapping[ShapeKey, Sequence[str]]) -> None:
        """Merge `entries` into the file (atomically: TP ranks may write at once)."""
        picks = {k: list(v) for k, v in self.load().items()}
        picks.update({str(k): list(v) for k, v in entries.items()})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = json.dumps({"key": self.key.as_dict(), "picks": picks}, indent=1, sort_keys=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(body)
        os.replace(tmp, self.path)


def summary(choices: Mapping[ShapeKey, Sequence[str]], source: str) -> str:
    """One line: each shape's pick per bucket, runs of equal picks merged."""
    parts = []
    for shape, picks in choices.items():
        runs: list[str] = []
        start = 0
        for b in range(1, len(picks) + 1):
            if b == len(picks) or picks[b] != picks[start]:
                first = BUCKETS[start][0]
                last = BUCKETS[b - 1][1]
                rows = f"{first}" if first == last else (f"{first}-{last}" if last else f"{first}+")
                runs.append(f"{rows}:{picks[start]}")
                start = b
        parts.append(f"{shape.n}x{shape.k} {shape.weight_dtype} [{' '.join(runs)}]")
    return f"CPU matmul kernels ({source}): " + "; ".join(parts)
