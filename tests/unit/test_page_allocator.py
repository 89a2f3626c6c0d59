"""PageAllocator: every page handed out once, double frees caught, state intact after errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.kvcache import OutOfPagesError, PageAllocator


def test_alloc_hands_out_distinct_pages_until_empty() -> None:
    alloc = PageAllocator(8)
    assert alloc.num_free == 8
    a = alloc.alloc(3)
    b = alloc.alloc(5)
    assert len(set(a) | set(b)) == 8
    assert set(a) | set(b) == set(range(8))
    assert alloc.num_free == 0 and alloc.num_used == 8
    assert alloc.alloc(0) == []


def test_alloc_when_short_raises_and_changes_nothing() -> None:
    alloc = PageAllocator(4)
    alloc.alloc(3)
    with pytest.raises(OutOfPagesError):
        alloc.alloc(2)
    assert alloc.num_free == 1
    assert len(alloc.alloc(1)) == 1


def test_freed_pages_are_reused() -> None:
    alloc = PageAllocator(2)
    pages = alloc.alloc(2)
    alloc.free(pages)
    assert alloc.num_free == 2
    assert sorted(alloc.alloc(2)) == sorted(pages)


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(lambda a, p: a.free([p[0]]) or a.free([p[0]]), id="twice"),
        pytest.param(lambda a, p: a.free([p[0], p[0]]), id="same-call"),
        pytest.param(lambda a, p: a.free([7]), id="never-allocated"),
        pytest.param(lambda a, p: a.free([8]), id="out-of-range"),
        pytest.param(lambda a, p: a.free([-1]), id="negative"),
    ],
)
def test_bad_free_raises_and_leaves_state_intact(bad) -> None:
    alloc = PageAllocator(8)
    pages = alloc.alloc(3)
    with pytest.raises(ValueError):
        bad(alloc, pages)
    # Whatever was legal before the error is still tracked exactly.
    still_used = [p for p in pages if alloc.is_allocated(p)]
    alloc.free(still_used)
    assert alloc.num_free == 8
    with pytest.raises(ValueError):
        alloc.free(pages[:1])


def test_invalid_construction_and_request() -> None:
    with pytest.raises(ValueError):
        PageAllocator(0)
    with pytest.raises(ValueError):
        PageAllocator(2).alloc(-1)


@settings(max_examples=60, deadline=None)
@given(
    num_pages=st.integers(1, 16),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 20)), max_size=40),
)
def test_random_alloc_free_never_leaks_or_duplicates(num_pages: int, ops) -> None:
    alloc = PageAllocator(num_pages)
    held: list[int] = []
    for is_alloc, n in ops:
        if is_alloc:
            if n > alloc.num_free:
                with pytest.raises(OutOfPagesError):
                    alloc.alloc(n)
            else:
                held.extend(alloc.alloc(n))
        else:
            k = min(n, len(held))
            alloc.free(held[:k])
            del held[:k]
        assert len(set(held)) == len(held)
        assert alloc.num_free + len(held) == num_pages
        assert all(alloc.is_allocated(p) for p in held)
    alloc.free(held)
    assert alloc.num_free == num_pages
