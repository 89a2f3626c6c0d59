"""The matmul chooser's bookkeeping (torch-free): buckets, picks from injected timings, the
on-disk cache's key and invalidation, the log line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minisgl.layers import kernel_choice as kc

SHAPE = kc.ShapeKey(3072, 1024, "bfloat16", "bfloat16", "bfloat16")


def key(**over: object) -> kc.MachineKey:
    base: dict = dict(
        cpu_model="AMD EPYC",
        flags=frozenset({"avx2", "fma", "avx512f"}),
        torch_version="2.13.0",
        threads=2,
        kernels="avx512-abc",
        policy=kc.policy(["gemv", "gemm"]),
    )
    base.update(over)
    return kc.MachineKey.of(**base)


def test_buckets_cover_every_row_count_at_their_edges() -> None:
    assert kc.BUCKET_NAMES == ("1", "2-4", "5-8", "9-16", "17-32", "33-64", "65-512", ">512")
    edges = {1: 0, 2: 1, 4: 1, 5: 2, 8: 2, 9: 3, 16: 3, 17: 4, 32: 4, 33: 5, 64: 5, 65: 6}
    edges.update({512: 6, 513: 7, 100000: 7})
    for rows, bucket in edges.items():
        assert kc.bucket_of(rows) == bucket, rows
    assert kc.bucket_of(0) == 0
    # Each bucket is timed at a row count inside it.
    assert [kc.bucket_of(r) for r in kc.TIMED_ROWS] == list(range(len(kc.BUCKETS)))


def test_row_table_matches_bucket_of() -> None:
    picks = ("a", "b", "c", "d", "e", "f", "g", "h")
    table = kc.row_table(picks)
    for rows in (1, 3, 8, 9, 16, 17, 32, 33, 64, 65, 512, 513, 4096):
        assert table[kc.table_index(rows)] == picks[kc.bucket_of(rows)]


def test_pick_takes_the_fastest_per_bucket() -> None:
    timings = {
        "gemv": [1.0, 2.0, 4.0, 8.0, 20.0, 30.0, 100.0, 100.0],
        "gemv512": [None, 1.5, 2.0, 3.0, 5.0, 10.0, 90.0, 90.0],  # cannot run the first bucket
        "gemm": [5.0, 5.0, 5.0, 5.0, 5.5, 6.0, 20.0, 20.0],
        "onednn": [2.0, 3.0, 3.0, 2.5, 6.0, 7.0, 10.0, 10.0],
    }
    picks = ("gemv", "gemv512", "gemv512", "onednn", "gemv512", "gemm", "onednn", "onednn")
    assert kc.pick(timings) == picks


def test_near_ties_go_to_the_earlier_candidate() -> None:
    timings = {"gemv": [1.0] * 8, "onednn": [1.0, 0.97, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0]}
    assert kc.pick(timings) == ("gemv", "gemv", "onednn", "gemv", "gemv", "gemv", "gemv", "gemv")


def test_the_default_is_the_incumbent() -> None:
    timings = {"gemv": [1.0] * 8, "gemm": [0.97] * 8, "onednn": [0.93] * 8}
    assert kc.pick(timings, prefer=("gemm",) * 8) == ("gemm",) * 8  # 3% is not enough
    assert kc.pick(timings) == ("onednn",) * 8


def test_one_layout_where_the_other_copy_saves_too_little() -> None:
    """A candidate on its own copy of the weight takes every bucket when the others' picks are
    not worth keeping the original for (on average within 10%, nowhere beyond 25%); a clear win
    keeps both copies."""
    picks = ("gemv", "panel", "panel", "panel", "panel", "panel", "gemm", "gemm")
    close = {
        "gemv": [1.0, 2.0, 4.0, 8.0, 20.0, 30.0, 100.0, 100.0],
        "gemm": [5.0, 5.0, 5.0, 5.0, 5.5, 6.0, 20.0, 20.0],
        "panel": [1.2, 1.0, 1.0, 1.0, 4.0, 5.0, 22.0, 22.0],  # 20% and 10% behind: 5% on average
    }
    assert kc.one_layout(picks, close, "panel") == ("panel",) * 8
    one_far = dict(close, panel=[1.3, 1.0, 1.0, 1.0, 4.0, 5.0, 20.0, 20.0])  # 30% behind in one
    assert kc.one_layout(picks, one_far, "panel") == picks
    four = ("gemv",) * 4 + ("panel",) * 4
    even = {"gemv": [1.0] * 8, "panel": [1.25] * 4 + [0.9] * 4}  # 12.5% behind on average
    assert kc.one_layout(four, even, "panel") == four
    assert kc.one_layout(("gemv",) * 8, close, "panel") == ("gemv",) * 8  # not picked anywhere
    cannot = dict(close, panel=[None, 1.0, 1.0, 1.0, 4.0, 5.0, 20.0, 20.0])
    assert kc.one_layout(picks, cannot, "panel") == picks


def test_a_disturbed_run_is_recognised() -> None:
    assert not kc.disturbed([1.02, 1.1, 1.05, 3.0])  # one burst does not make a run noisy
    assert kc.disturbed([2.0, 1.8, 1.1, 4.0])
    assert not kc.disturbed([])


def test_pick_refuses_a_bucket_nobody_ran() -> None:
    with pytest.raises(ValueError, match="33-64"):
        kc.pick({"gemv": [1.0, 1.0, 1.0, 1.0, 1.0, None, 1.0, 1.0]})


def test_forced_candidate_applies_where_available() -> None:
    default = ("gemv",) * 4 + ("gemm",) * 4
    assert kc.forced("onednn", ["gemv", "onednn"], default) == ("onednn",) * 8
    assert kc.forced("onednn", ["gemv", "gemm"], default) == default


def timings_of(winner: str, names: tuple[str, ...] = ("gemv", "gemm", "onednn")) -> dict:
    return {n: [1.0 if n == winner else 2.0] * 8 for n in names}


def test_cache_round_trip_and_merge(tmp_path: Path) -> None:
    """The cache keeps timings (picks follow from them under each start's copy allowance)."""
    cache = kc.TuningCache(tmp_path, key())
    avail = ["gemv", "gemm", "onednn"]
    assert cache.get(SHAPE, avail) is None
    timings = {"gemv": [1.0] * 7 + [None], "gemm": [2.0] * 8, "onednn": [3.0] * 8}
    cache.put({SHAPE: timings})
    other = kc.ShapeKey(1024, 3072, "bfloat16", "bfloat16", "bfloat16")
    cache.put({other: timings_of("gemm")})  # a second shape joins, the first stays
    again = kc.TuningCache(tmp_path, key())
    assert again.get(SHAPE, avail) == timings
    assert again.get(other, avail) == timings_of("gemm")
    assert again.get(SHAPE, ["gemm"]) == {"gemm": [2.0] * 8}  # fewer candidates: a subset


@pytest.mark.parametrize(
    "change",
    [
        {"cpu_model": "Intel Xeon"},
        {"flags": frozenset({"avx2", "fma"})},
        {"torch_version": "2.14.0"},
        {"threads": 4},
        {"kernels": "avx512-def"},
        {"policy": kc.policy(["gemv", "panel"])},  # new candidates re-measure
    ],
)
def test_cache_is_keyed_by_machine_torch_threads_and_kernels(tmp_path: Path, change: dict) -> None:
    kc.TuningCache(tmp_path, key()).put({SHAPE: timings_of("gemv", ("gemv",))})
    assert kc.TuningCache(tmp_path, key(**change)).get(SHAPE, ["gemv"]) is None
    assert kc.TuningCache(tmp_path, key()).get(SHAPE, ["gemv"]) == timings_of("gemv", ("gemv",))


def test_cache_entries_that_no_longer_apply_are_ignored(tmp_path: Path) -> None:
    cache = kc.TuningCache(tmp_path, key())
    cache.put({SHAPE: timings_of("gemv512", ("gemv512",))})
    # A candidate available now was never timed (e.g. a build with new kernels): measure again.
    assert cache.get(SHAPE, ["gemv", "gemm"]) is None
    # A file whose stored key is not ours (edited, or a digest collision) is not trusted.
    data = json.loads(cache.path.read_text())
    data["key"]["threads"] = 64
    cache.path.write_text(json.dumps(data))
    assert cache.get(SHAPE, ["gemv512"]) is None
    # Malformed entries are dropped, well-formed ones kept.
    data["key"]["threads"] = 2
    data["timings"]["bad"] = {"gemv": [1.0, "x"]}
    cache.path.write_text(json.dumps(data))
    assert set(cache.load()) == {str(SHAPE)}
    cache.path.write_text("{not json")
    assert cache.load() == {}


def test_single_layout_takes_the_layout_least_slow_over_all_buckets() -> None:
    """One layout of the weight: each layout's own best per bucket, and of those the one
    closest to the best of all on average (not the one winning most buckets)."""
    timings = {
        "gemv": [1.0, 1.0, 1.0, 1.0, 4.0, 4.0, 8.0, 8.0],
        "gemm": [3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 6.0, 6.0],
        "panel": [1.1, 1.1, 1.1, 1.1, 2.0, 2.0, 3.0, 3.0],
        "onednn": [5.0, 5.0, 5.0, 5.0, 1.0, 1.0, 1.0, 1.0],
    }
    # row: 1 x4, 3/1 x2, 6/1 x2 -> 2.75; panel: 1.1 x4, 2 x2, 3 x2 -> 1.8; onednn: 5 x4, 1 x4 -> 3
    assert kc.single_layout(timings) == ("panel",) * 8
    assert kc.single_layout(timings, allowed=("row",)) == ("gemv",) * 4 + ("gemm",) * 4
    assert kc.single_layout(timings, allowed=("row", "onednn")) == ("gemv",) * 4 + ("gemm",) * 4
    # A near tie stays with the earlier layout (the row-major weight needs no repacking); an
    # average over the buckets 3% less slow is no tie (it jitters less than one bucket).
    tie = {"gemv": [1.0] * 8, "panel": [0.99] * 8}
    assert kc.single_layout(tie) == ("gemv",) * 8
    ahead = {"gemv": [1.0] * 8, "panel": [0.97] * 8}
    assert kc.single_layout(ahead) == ("panel",) * 8
    # Panels 10% ahead at 2-16 rows, level elsewhere: ~3.6% less slow on average.
    decode = {"gemv": [1.0] * 8, "panel": [1.0] + [0.9] * 3 + [1.0] * 4}
    assert kc.single_layout(decode) == ("panel",) * 8
    # A layout that cannot run some bucket is no single layout.
    gap = {"gemv": [1.0] * 8, "onednn": [0.1] * 7 + [None]}
    assert kc.single_layout(gap) == ("gemv",) * 8
    with pytest.raises(ValueError, match="no layout"):
        kc.single_layout(gap, allowed=("onednn",))


def test_copies_are_allotted_most_gain_per_byte_first_within_the_budget() -> None:
    row, mixed = ("gemv",) * 8, ("gemv",) * 4 + ("onednn",) * 4
    small = kc.CopyOption(row, mixed, extra_bytes=100, gain=0.5)  # 0.005 per byte
    big = kc.CopyOption(row, mixed, extra_bytes=1000, gain=2.0)  # 0.002 per byte
    nothing = kc.CopyOption(row, row, extra_bytes=0, gain=0.0)
    assert kc.allot_copies([small, big, nothing], 0) == [False, False, False]
    assert kc.allot_copies([small, big, nothing], 1000) == [True, False, False]
    assert kc.allot_copies([big, small], 1000) == [False, True]
    assert kc.allot_copies([small, big], 1100) == [True, True]


def test_a_copy_must_buy_enough_and_says_what_it_buys() -> None:
    timings = {"gemv": [1.0] * 4 + [2.0, 3.0, 6.0, 6.0], "onednn": [4.0] * 4 + [1.0, 1.0, 2.0, 2.0]}
    row, mixed = ("gemv",) * 8, ("gemv",) * 4 + ("onednn",) * 4
    assert kc.copy_worth(row, mixed, timings)
    assert kc.speedups(row, mixed, timings) == (
        "rows 17-32 2.00x, 33-64 3.00x, 65-512 3.00x, >512 3.00x faster"
    )
    close = {"gemv": [1.0] * 8, "onednn": [4.0] * 4 + [0.96] * 4}
    assert not kc.copy_worth(row, mixed, close)
    assert kc.slowdown(row, timings) == pytest.approx((4 + 2 + 3 + 3 + 3) / 8)
    assert kc.layouts_of(mixed) == ("row", "onednn")


def test_summary_is_one_line_with_merged_runs() -> None:
    line = kc.summary({SHAPE: ("gemv512",) * 3 + ("onednn",) * 5}, "measured, 1.2 s")
    assert "\n" not in line
    assert line == (
        "CPU matmul kernels (measured, 1.2 s): 3072x1024 bfloat16 [1-8:gemv512 9+:onednn]"
    )


def test_other_processes_cpu_time_is_seen() -> None:
    """A steady load beside the timings (busy processes on our CPUs) reads as a share of the
    CPUs' time well above the limit under which timings are cached."""
    import os
    import subprocess
    import sys
    import time

    cpus = sorted(os.sched_getaffinity(0))
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(min(len(cpus), 4))
    ]
    try:
        others = kc.OtherWork()
        deadline = time.monotonic() + 30
        while (share := others.share()) <= 2 * kc.OTHER_WORK_LIMIT:
            assert time.monotonic() < deadline, share
            time.sleep(0.1)
    finally:
        for b in burners:
            b.kill()
            b.wait()


def test_contenders_are_the_leader_those_within_reach_and_the_default() -> None:
    best = {"a": 1.0, "b": 1.0 + kc.CONFIRM_WITHIN, "c": 1.5, "d": 0.9}
    assert kc.contenders(best) == ["d", "a"]  # b: 1.2 > 0.9 * 1.2
    assert kc.contenders(best, default="c") == ["d", "a", "c"]
    assert kc.contenders(best, default="a") == ["d", "a"]
    assert kc.contenders({"a": 1.0, "b": 2.0}) == ["a"]  # nothing to confirm
