"""RadixCache: whole-page prefix matching, splits, dedup on insert, locks and LRU eviction."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.kvcache import PageAllocator, RadixCache, RadixNode

PS = 4


def make(num_pages: int = 32, page_size: int = PS, enabled: bool = True):
    alloc = PageAllocator(num_pages)
    return alloc, RadixCache(page_size, alloc, enabled=enabled)


def put(alloc: PageAllocator, cache: RadixCache, tokens: list[int]) -> list[int]:
    """Allocate pages for the whole pages of `tokens` and hand them to the cache."""
    pages = alloc.alloc(len(tokens) // cache.page_size)
    return cache.insert(tokens, pages).pages


def check_tree(alloc: PageAllocator, cache: RadixCache) -> None:
    """Structural invariants: key/page sizes, child keys, counters, page ownership."""
    nodes = cache.nodes()
    pages = cache.all_pages()
    assert len(pages) == len(set(pages)) == cache.num_pages
    assert all(alloc.is_allocated(p) for p in pages)
    assert cache.num_evictable_pages == sum(len(n.pages) for n in nodes if n.ref == 0)
    for node in [cache.root, *nodes]:
        for first, child in node.children.items():
            assert child.parent is node
            assert first == tuple(child.key[: cache.page_size])
            assert len(child.pages) >= 1
            assert len(child.key) == len(child.pages) * cache.page_size
            assert child.ref <= node.ref or node.is_root
        if not node.is_root:
            assert node.ref >= sum(c.ref for c in node.children.values())


def test_empty_cache_matches_nothing() -> None:
    _, cache = make()
    m = cache.match_prefix(list(range(20)))
    assert m.pages == [] and m.node is cache.root


def test_match_is_whole_pages_only() -> None:
    alloc, cache = make()
    seq = list(range(12))
    pages = put(alloc, cache, seq)
    assert cache.match_prefix(seq).pages == pages
    assert cache.match_prefix(seq + [99]).pages == pages
    # 11 tokens cover only 2 whole pages; a mismatch inside page 2 stops before that page.
    assert cache.match_prefix(seq[:11]).pages == pages[:2]
    assert cache.match_prefix(seq[:9] + [99, 10, 11]).pages == pages[:2]
    assert cache.match_prefix([99] + seq[1:]).pages == []
    assert cache.match_prefix(seq[:3]).pages == []


def test_insert_ignores_tokens_beyond_the_given_pages() -> None:
    alloc, cache = make()
    pages = alloc.alloc(2)
    res = cache.insert(list(range(11)), pages)  # 11 tokens, only 2 pages' worth inserted
    assert res.pages == pages and cache.num_pages == 2
    with pytest.raises(ValueError):
        cache.insert(list(range(7)), alloc.alloc(2))


def test_partial_match_splits_the_edge() -> None:
    alloc, cache = make()
    a = list(range(16))
    pages = put(alloc, cache, a)
    assert len(cache.nodes()) == 1
    m = cache.match_prefix(a[:8] + [100] * 8)
    assert m.pages == pages[:2]
    assert len(cache.nodes()) == 2
    assert m.node.key == a[:8] and m.node.pages == pages[:2]
    (lower,) = m.node.children.values()
    assert lower.key == a[8:] and lower.pages == pages[2:]
    # The split changes nothing observable about the full sequence.
    assert cache.match_prefix(a).pages == pages
    check_tree(alloc, cache)


def test_diverging_insert_branches_and_shares_the_prefix() -> None:
    alloc, cache = make()
    a = list(range(12))
    b = a[:4] + [50 + i for i in range(8)]
    pa = put(alloc, cache, a)
    pb = put(alloc, cache, b)
    assert pb[0] == pa[0] and pb[1:] != pa[1:]
    assert cache.num_pages == 5
    shared = cache.match_prefix(a).node.parent
    assert shared is not None and shared.key == a[:4] and len(shared.children) == 2
    check_tree(alloc, cache)


def test_insert_of_a_cached_range_frees_the_duplicates() -> None:
    alloc, cache = make(num_pages=10)
    seq = list(range(12))
    first = put(alloc, cache, seq)
    free_before = alloc.num_free
    mine = alloc.alloc(4)  # computed the same 3 pages again, plus a 4th new one
    res = cache.insert(seq + [7, 7, 7, 7], mine)
    assert res.pages == first + [mine[3]]
    assert res.num_duplicates == 3
    assert alloc.num_free == free_before - 1
    assert not any(alloc.is_allocated(p) for p in mine[:3])
    # Pages the caller got from the cache itself are not duplicates.
    res2 = cache.insert(seq + [7, 7, 7, 7], res.pages)
    assert res2.num_duplicates == 0 and res2.pages == res.pages
    check_tree(alloc, cache)


def test_insert_returns_the_node_ending_at_the_range() -> None:
    alloc, cache = make()
    seq = list(range(16))
    put(alloc, cache, seq)
    res = cache.insert(seq[:8], cache.match_prefix(seq[:8]).pages)
    assert res.node.key == seq[:8] and res.node.pages == res.pages  # the edge was split
    assert cache.match_prefix(seq[:8]).node is res.node
    assert cache.insert([], []).node is cache.root


def test_lock_pins_the_whole_path_and_unlock_releases_it() -> None:
    alloc, cache = make()
    a = list(range(12))
    b = a[:4] + [9] * 8
    put(alloc, cache, a)
    put(alloc, cache, b)
    node_a = cache.match_prefix(a).node
    cache.lock(node_a)
    assert cache.num_locked_pages == 3  # the shared page and a's own two
    assert cache.num_evictable_pages == 2
    assert node_a.ref == 1 and node_a.parent.ref == 1
    # Only b's private pages can go, even when more is asked.
    assert cache.evict(100) == 2
    assert cache.match_prefix(b).pages == cache.match_prefix(a).pages[:1]
    assert cache.match_prefix(a).node is node_a
    cache.lock(node_a)
    cache.unlock(node_a)
    assert node_a.ref == 1
    cache.unlock(node_a)
    assert cache.num_locked_pages == 0
    with pytest.raises(RuntimeError):
        cache.unlock(node_a)
    assert cache.evict(100) == 3
    assert alloc.num_free == alloc.num_pages
    check_tree(alloc, cache)


def test_split_keeps_lock_counts_on_both_halves() -> None:
    alloc, cache = make()
    a = list(range(16))
    put(alloc, cache, a)
    node = cache.match_prefix(a).node
    cache.lock(node)
    upper = cache.match_prefix(a[:8] + [0] * 8).node  # splits the locked edge
    assert upper.ref == 1 and node.ref == 1 and node.parent is upper
    assert cache.num_locked_pages == 4 and cache.num_evictable_pages == 0
    cache.unlock(node)
    assert upper.ref == 0 and cache.num_evictable_pages == 4
    check_tree(alloc, cache)


def test_evict_is_lru_over_unlocked_leaves_and_trims_the_last_one() -> None:
    alloc, cache = make()
    seqs = [[i] * 8 for i in range(1, 4)]  # three independent 2-page sequences
    for s in seqs:
        put(alloc, cache, s)
    cache.match_prefix(seqs[0])  # touch the oldest: seqs[1] is now the least recently used
    assert cache.evict(1) == 1  # the tail page of seqs[1]; its first page stays usable
    assert len(cache.match_prefix(seqs[1]).pages) == 1
    cache.match_prefix(seqs[0])
    assert cache.evict(3) == 3  # the rest of seqs[1] (touched before seqs[2]), then seqs[2]
    assert cache.match_prefix(seqs[1]).pages == []
    assert cache.match_prefix(seqs[2]).pages == []
    assert len(cache.match_prefix(seqs[0]).pages) == 2
    assert alloc.num_free == alloc.num_pages - 2
    check_tree(alloc, cache)


def test_evict_walks_up_to_parents_once_their_children_are_gone() -> None:
    alloc, cache = make()
    a = list(range(12))
    b = a[:4] + [7] * 8
    put(alloc, cache, a)
    put(alloc, cache, b)
    assert cache.num_pages == 5
    assert cache.evict(5) == 5
    assert cache.nodes() == [] and alloc.num_free == alloc.num_pages
    assert cache.evict(1) == 0


def test_reset_refuses_while_locked() -> None:
    alloc, cache = make()
    put(alloc, cache, list(range(8)))
    node = cache.match_prefix(list(range(8))).node
    cache.lock(node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.unlock(node)
    assert cache.reset() == 2 and alloc.num_free == alloc.num_pages


def test_disabled_cache_keeps_nothing() -> None:
    alloc, cache = make(enabled=False)
    pages = alloc.alloc(3)
    res = cache.insert(list(range(12)), pages)
    assert res.pages == [] and res.node is cache.root
    assert alloc.num_free == alloc.num_pages
    assert cache.match_prefix(list(range(12))).pages == []
    assert cache.num_pages == 0


def test_page_size_one_behaves_as_a_token_radix_tree() -> None:
    alloc, cache = make(page_size=1)
    put(alloc, cache, [1, 2, 3, 4])
    put(alloc, cache, [1, 2, 5])
    assert cache.num_pages == 5
    assert len(cache.match_prefix([1, 2, 3, 9]).pages) == 3
    check_tree(alloc, cache)


# ---- property test: random operations -----------------------------------------------------

op = st.one_of(
    st.tuples(st.just("insert"), st.lists(st.integers(1, 3), min_size=0, max_size=14)),
    st.tuples(st.just("lock"), st.lists(st.integers(1, 3), min_size=0, max_size=14)),
    st.tuples(st.just("unlock"), st.integers(0, 100)),
    st.tuples(st.just("evict"), st.integers(0, 6)),
)


@settings(max_examples=150, deadline=None)
@given(page_size=st.integers(1, 3), ops=st.lists(op, max_size=30))
def test_random_operations_keep_pages_and_locks_consistent(page_size: int, ops) -> None:
    alloc, cache = make(num_pages=40, page_size=page_size)
    # What each lock holder believes it pinned: (node, token prefix, pages).
    locks: list[tuple[RadixNode, list[int], list[int]]] = []
    for kind, arg in ops:
        if kind == "insert":
            n = len(arg) // page_size
            if n > alloc.num_free:
                cache.evict(n - alloc.num_free)
            if n > alloc.num_free:
                continue
            res = cache.insert(arg, alloc.alloc(n))
            assert len(res.pages) == n
            assert cache.match_prefix(arg).pages == res.pages
        elif kind == "lock":
            m = cache.match_prefix(arg)
            cache.lock(m.node)
            locks.append((m.node, list(arg[: m.num_pages * page_size]), m.pages))
        elif kind == "unlock" and locks:
            node, _, _ = locks.pop(arg % len(locks))
            cache.unlock(node)
        elif kind == "evict":
            before = cache.num_evictable_pages
            freed = cache.evict(arg)
            assert freed == min(arg, before)
        check_tree(alloc, cache)
        assert alloc.num_used == cache.num_pages  # the cache owns every allocated page here
        # Locked prefixes survive everything, with the same pages.
        for node, tokens, pages in locks:
            assert cache.match_prefix(tokens).pages == pages
            path: list[int] = []
            cur: RadixNode | None = node
            while cur is not None:
                path[:0] = cur.pages
                cur = cur.parent
            assert path == pages
        for node in cache.nodes():
            holders = 0
            for locked, _, _ in locks:
                cur = locked
                while cur is not None and cur is not node:
                    cur = cur.parent
                holders += cur is node
            assert node.ref == holders
    for node, _, _ in locks:
        cache.unlock(node)
    cache.reset()
    assert alloc.num_free == alloc.num_pages
