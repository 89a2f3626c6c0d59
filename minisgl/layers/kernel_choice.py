"""Which CPU matmul runs for which layer shape and row count: the bookkeeping, torch-free.

What is fastest differs from one CPU to the next (AVX2 vs AVX-512 vs AMX, MKL vs oneDNN vs our
kernels, bandwidth vs FLOPs), so nothing here is a tuned constant: cpu_linear.py times the
candidates on the running machine and this module
- splits row counts into buckets (1, 2-4, 5-8, 9-16, 17-32, 33-64, 65-512, >512) and names the
  row count timed for each;
- picks the fastest candidate per bucket from measured (or, in tests, injected) timings, either
  among those that run on one layout of the weight (the default: the weights in memory once) or
  with a second layout kept where the user allows memory for it and it buys enough;
- shares a memory allowance for second copies out between the layers, most speed per byte
  first;
- keys the timings by what decides them (CPU model and flags, torch version, threads, the
  kernels' build, the candidates) and keeps them in a JSON file in the cache directory, so a
  restart does not re-tune, and a different machine, torch or kernel build never reads
  another's. The timings are cached, not the picks: picks follow from them under whatever copy
  allowance a start is given, so a new allowance needs no new measurement;
- says in one line what was picked.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# (first, last) rows of each bucket; None: no upper end.
BUCKETS: tuple[tuple[int, int | None], ...] = (
    (1, 1),
    (2, 4),
    (5, 8),
    (9, 16),
    (17, 32),
    (33, 64),
    (65, 512),
    (513, None),
)
BUCKET_NAMES = tuple(f"{a}" if a == b else (f"{a}-{b}" if b else f">{a - 1}") for a, b in BUCKETS)
# The row count timed for each bucket: its top (the costliest case a bucket's pick must serve),
# and for the two prefill buckets a chunk of their size: which kernel wins a short prompt's
# prefill and a long chunk's differs (on a Xeon with AMX, our AMX kernel ahead at 256 rows and
# oneDNN's at 3840: one open bucket timed at 256 ran long prefills 8-15% slower). Decode batches
# of 17-64 are two buckets: one timed at 64 rows ranked a 32-row batch's kernels wrong (on an
# AVX2 EPYC our GEMM ran 36 rows' FMAs for 32 and the panels were 14% ahead in a B=32 step,
# 5% at 64 rows).
TIMED_ROWS = (1, 4, 8, 16, 32, 64, 256, 1024)
MODES = ("cached", "full", "off")
# Rows above which every bucket lookup is the last bucket's.
_TABLE_ROWS = 513


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


# The timing passes after which a candidate more than DROP_BEHIND times the leader's best stops
# running (both choosers). Two, not one: a burst of other work over one first pass is common on
# a shared machine, and a kernel dropped on it is lost for the bucket, and with it, where it is a
# layout's best, that layout for every row count (the Xeon of docs/performance.md: one disturbed
# pass dropped amx_bf16_vpanel at 1024 rows for an 8-bit 6144x1024, which then ran its slower
# row-major kernel at one row, 27 GB/s where the panels read 32).
DROP_AFTER = 2
DROP_BEHIND = 3.0


# After the passes, a near tie is timed again rather than decided by the passes a burst of other
# work may have fallen on: the leader and every candidate within CONFIRM_WITHIN of its best
# (and the bucket's default, where the chooser has one and it is not the leader) take
# CONFIRM_REPEATS more passes in turn (both choosers). On the Xeon of docs/performance.md an
# 8-bit 6144x1024 kept amx_vpanel at 65-512 rows from one such run (amx_bf16_vpanel is 1.1x
# faster there), and a 512-token int8 prefill ran 0.90x bf16's rate instead of 0.95x.
CONFIRM_WITHIN = 0.2
CONFIRM_REPEATS = 3


def contenders(best: Mapping[str, float], default: str | None = None) -> list[str]:
    """Who takes the confirming passes (CONFIRM_WITHIN): the leader first, then the others
    within reach of it, then `default` if it is neither; [leader] alone: nothing to confirm."""
    leader = min(best, key=best.__getitem__)
    reach = (1 + CONFIRM_WITHIN) * best[leader]
    out = [leader] + [n for n in best if n != leader and best[n] <= reach]
    if default is not None and default in best and default not in out:
        out.append(default)
    return out


def policy(candidates: Sequence[str]) -> str:
    """What the cached timings cover, for the cache key: new candidates re-measure, as do
    timings taken under another drop or confirm rule. (Margins and the copy allowance only turn timings
    into picks, at every start.)"""
    rows = ",".join(map(str, TIMED_ROWS))
    return (
        f"{','.join(candidates)};timings at {rows} rows;weights flushed from the caches"
        f";drop after {DROP_AFTER};confirm {CONFIRM_REPEATS} within {CONFIRM_WITHIN}"
    )


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


# The layout of the weight each candidate computes from: the weight as loaded ("row"), or a copy
# made once in a layout of its own. A layer keeps the layouts its picks read, and no others.
LAYOUT = {
    "gemv": "row",
    "gemv512": "row",
    "amx": "row",
    "gemm": "row",
    "torch": "row",
    "panel": "panel",
    "onednn": "onednn",
}
# The order layouts are tried in: an earlier one keeps a near tie (the row-major weight needs
# no repacking at start).
LAYOUTS = ("row", "panel", "onednn")

Timings = Mapping[str, Sequence[float | None]]


def layouts_of(picks: Sequence[str]) -> tuple[str, ...]:
    """The layouts `picks` read, in LAYOUTS' order."""
    used = {LAYOUT[p] for p in picks}
    return tuple(layout for layout in LAYOUTS if layout in used)


def slowdown(picks: Sequence[str], timings: Timings) -> float:
    """How much slower `picks` are than the fastest candidate of each bucket, on average over
    the buckets (1.0: the fastest everywhere): the cost of a restriction, as one number."""
    ratios = []
    for b, name in enumerate(picks):
        t = timings[name][b]
        best = min((x for ts in timings.values() if (x := ts[b]) is not None), default=None)
        if t is None or best is None or best <= 0:
            ratios.append(1.0)
        else:
            ratios.append(t / best)
    return sum(ratios) / len(ratios)


# What a later layout must be less slow by, on average over the buckets, to replace an earlier
# one: an average over len(BUCKETS) timings jitters ~sqrt(len(BUCKETS)) times less than one
# bucket's (MARGIN), and keeping the row-major weight saves only its repacking at start. At
# MARGIN, panels 10-13% ahead at 2-16 rows and level elsewhere (3-4% less slow on average)
# left a 2-core AVX2 EPYC's decode batches on the GEMV and our GEMM.
LAYOUT_MARGIN = MARGIN / len(BUCKETS) ** 0.5


def single_layout(
    timings: Timings, prefer: Sequence[str] | None = None, allowed: Sequence[str] = LAYOUTS
) -> tuple[str, ...]:
    """The picks for a layer that keeps one layout of its weight: per layout (among `allowed`)
    whose candidates ran in every bucket, its fastest per bucket (as `pick`); of those, the one
    least slow against the fastest of all per bucket (`slowdown`). A later layout must be more
    than LAYOUT_MARGIN less slow to replace an earlier one."""
    best: tuple[float, tuple[str, ...]] | None = None
    for layout in LAYOUTS:
        if layout not in allowed:
            continue
        own = {n: ts for n, ts in timings.items() if LAYOUT.get(n) == layout}
        if not own or any(all(ts[b] is None for ts in own.values()) for b in range(len(BUCKETS))):
            continue
        picks = pick(own, prefer)
        cost = slowdown(picks, timings)
        if best is None or cost < best[0] * (1 - LAYOUT_MARGIN):
            best = (cost, picks)
    if best is None:
        raise ValueError(f"no layout among {list(allowed)} runs every row count")
    return best[1]


def copy_worth(single: Sequence[str], full: Sequence[str], timings: Timings) -> bool:
    """Whether `full` (picks on two layouts) is worth a second copy of the weight over `single`:
    on average over the buckets more than COPY_WORTH faster, or in one bucket more than
    COPY_WORTH_ONE_BUCKET (the same rule that decides whether the row-major weight is kept
    beside panels, see one_layout)."""
    ratios = []
    for b, (a, f) in enumerate(zip(single, full)):
        ta, tf = timings[a][b], timings[f][b]
        ratios.append(ta / tf if ta is not None and tf is not None and tf > 0 else 1.0)
    return sum(ratios) / len(ratios) > 1 + COPY_WORTH or max(ratios) > 1 + COPY_WORTH_ONE_BUCKET


def speedups(single: Sequence[str], full: Sequence[str], timings: Timings) -> str:
    """Where `full` is faster than `single`, by how much: "rows 17-64 1.8x, >64 2.0x faster"."""
    parts = []
    for b, (a, f) in enumerate(zip(single, full)):
        ta, tf = timings[a][b], timings[f][b]
        if ta is not None and tf is not None and tf > 0 and ta > tf * (1 + MARGIN):
            parts.append(f"{BUCKET_NAMES[b]} {ta / tf:.2f}x")
    return f"rows {', '.join(parts)} faster" if parts else "no row count faster"


@dataclass(frozen=True)
class CopyOption:
    """One layer shape's choice: `single` keeps one layout of each weight, `full` keeps
    `extra_bytes` more (over all the layers of that shape) and is `gain` less slow (`slowdown`
    of single minus that of full)."""

    single: tuple[str, ...]
    full: tuple[str, ...]
    extra_bytes: int
    gain: float


def allot_copies(options: Sequence[CopyOption], budget_bytes: int) -> list[bool]:
    """Which options get their second copies within `budget_bytes` in all: those that gain
    something, most gain per byte first, each only if it still fits whole."""
    granted = [False] * len(options)
    order = sorted(
        (i for i, o in enumerate(options) if o.gain > 0 and o.extra_bytes > 0),
        key=lambda i: -options[i].gain / options[i].extra_bytes,
    )
    left = budget_bytes
    for i in order:
        if options[i].extra_bytes <= left:
            granted[i] = True
            left -= options[i].extra_bytes
    return granted


def disturbed(spreads: Sequence[float], limit: float = 1.5) -> bool:
    """Whether timings were taken while other work held the cores: `spreads` are each
    candidate's slowest pass over its fastest; on a quiet machine they stay near 1. Picks from
    a disturbed run are used but not cached, so a later start measures again."""
    ordered = sorted(spreads)
    return bool(ordered) and ordered[len(ordered) // 2] > limit


# The share of our CPUs' time that other processes (or the hypervisor, as steal) may take while
# the candidates are timed for the timings still to be cached. A steady load slows every pass
# alike, so the spreads above miss it, yet it decides the picks: timings taken beside other
# busy processes, cached, once left a quiet machine's B=1 decode a third slower at every start.
OTHER_WORK_LIMIT = 0.1


class OtherWork:
    """CPU time the rest of the machine spent on our CPUs since construction, from /proc/stat
    minus this process's own (Linux; elsewhere it reads 0)."""

    def __init__(self) -> None:
        self._cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self._start = _cpu_times(self._cpus)

    def share(self) -> float:
        """Others' CPU seconds over the CPU seconds our CPUs had since construction."""
        end = _cpu_times(self._cpus)
        if self._start is None or end is None or not self._cpus:
            return 0.0
        wall = end[0] - self._start[0]
        if wall <= 0:
            return 0.0
        others = (end[1] - self._start[1]) - (end[2] - self._start[2])
        # Both counts tick in 1/CLK_TCK s per CPU: what a short window cannot tell from noise.
        slack = (len(self._cpus) + 1) / os.sysconf("SC_CLK_TCK")
        return max(0.0, others - slack) / (wall * len(self._cpus))


def _cpu_times(cpus: Sequence[int]) -> tuple[float, float, float] | None:
    """(monotonic seconds, busy seconds of `cpus`, this process's CPU seconds)."""
    wanted = {f"cpu{c}" for c in cpus}
    busy = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                fields = line.split()
                if fields and fields[0] in wanted:
                    # user nice system idle iowait irq softirq steal: all but idle and iowait
                    ticks = [int(v) for v in fields[1:9]]
                    busy += sum(ticks) - ticks[3] - ticks[4]
    except (OSError, ValueError):
        return None
    own = os.times()
    return time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), own.user + own.system


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
    """Timings per shape for one MachineKey, in `root`/cpu-linear-<digest>.json. A file whose
    stored key differs from ours (a hash collision, a hand edit) is ignored, as is an entry that
    lacks a candidate available here or is malformed."""

    def __init__(self, root: Path, key: MachineKey) -> None:
        self.key = key
        self.path = Path(root) / f"cpu-linear-{key.digest()}.json"

    def load(self) -> dict[str, dict[str, list[float | None]]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("key") != self.key.as_dict():
            return {}
        entries = data.get("timings")
        if not isinstance(entries, dict):
            return {}
        return {k: v for k, v in entries.items() if _well_formed(v)}

    def get(
        self, shape: ShapeKey, available: Sequence[str]
    ) -> dict[str, list[float | None]] | None:
        """The timings of every candidate in `available` for `shape`, or None where any lacks."""
        got = self.load().get(str(shape))
        if got is None or any(name not in got for name in available):
            return None
        return {name: got[name] for name in available}

    def put(self, entries: Mapping[ShapeKey, Timings]) -> None:
        """Merge `entries` into the file (atomically: TP ranks may write at once)."""
        timings = self.load()
        timings.update({str(k): {n: list(t) for n, t in v.items()} for k, v in entries.items()})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = json.dumps({"key": self.key.as_dict(), "timings": timings}, indent=1, sort_keys=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(body)
        os.replace(tmp, self.path)


def _well_formed(entry: object) -> bool:
    return isinstance(entry, dict) and all(
        isinstance(ts, list)
        and len(ts) == len(BUCKETS)
        and all(t is None or (isinstance(t, (int, float)) and t >= 0) for t in ts)
        for ts in entry.values()
    )


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
