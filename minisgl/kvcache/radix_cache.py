"""Radix prefix cache over token ids, at page granularity (torch-free bookkeeping).

Every edge holds a whole number of pages: its token key (a multiple of `page_size` tokens) and
the page ids holding their KV. A page's KV depends on every token before it, so a page is only
shareable along the exact path from the root: a tree keyed by token ids captures that.

Ownership: pages handed to `insert` belong to the cache from then on; the cache gives them back
to the allocator when it evicts them (or at once, when it already holds the same range, or when
it is disabled). Users of a cached prefix `lock` its end node: a lock counts on every node of the
path, and only nodes with no lock are evicted, least recently used leaves first.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from minisgl.kvcache.page_allocator import PageAllocator


class RadixNode:
    __slots__ = ("children", "key", "last_access", "pages", "parent", "ref")

    def __init__(self, key: list[int], pages: list[int], parent: RadixNode | None) -> None:
        self.key = key
        self.pages = pages
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.ref = 0  # locks on this node or on any node below it
        self.last_access = 0

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __repr__(self) -> str:
        return f"RadixNode(tokens={len(self.key)}, pages={self.pages}, ref={self.ref})"


@dataclass
class MatchResult:
    pages: list[int]  # cached pages covering the first num_tokens tokens
    node: RadixNode  # deepest node of the match (the root when nothing matched): lock this

    @property
    def num_pages(self) -> int:
        return len(self.pages)


@dataclass
class InsertResult:
    pages: list[int]  # the cache's pages for the inserted range: the caller's page table prefix
    node: RadixNode  # node ending exactly at the inserted range (the root if it was empty)
    num_duplicates: int  # caller pages the cache already held a copy of, freed


class RadixCache:
    def __init__(self, page_size: int, allocator: PageAllocator, enabled: bool = True) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.allocator = allocator
        self.enabled = enabled
        self.root = RadixNode([], [], None)
        self._num_pages = 0
        self._num_evictable = 0
        self._clock = 0

    # ---- counts ---------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        """Pages held by the tree (locked or not)."""
        return self._num_pages

    @property
    def num_evictable_pages(self) -> int:
        """Pages held only by the tree: no lock on their node, so eviction may free them."""
        return self._num_evictable

    @property
    def num_locked_pages(self) -> int:
        return self._num_pages - self._num_evictable

    # ---- lookup ---------------------------------------------------------------------------
    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """Longest cached prefix of `token_ids`, in whole pages.

        Splits an edge when the match ends inside it, so the returned node ends exactly at the
        match and can be locked without pinning pages the caller does not use.
        """
        if not self.enabled:
            return MatchResult([], self.root)
        tick = self._tick()
        node = self.root
        node.last_access = tick
        pages: list[int] = []
        pos = 0
        ps = self.page_size
        while pos + ps <= len(token_ids):
            child = node.children.get(tuple(token_ids[pos : pos + ps]))
            if child is None:
                break
            n = self._common_pages(child.key, token_ids, pos)
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = tick
            pages.extend(child.pages)
            pos += len(child.key)
            node = child
        return MatchResult(pages, node)

    # ---- insertion --------------------------------------------------------------------------
    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> InsertResult:
        """Give the cache `pages`, the KV of `token_ids[: len(pages) * page_size]`.

        Where the tree already holds that range, the tree's pages win: any caller page that
        differs from the tree's at the same position is a duplicate and is freed here. The caller
        must switch its page table to `result.pages`. A disabled cache keeps nothing: it frees
        every page given to it.
        """
        ps = self.page_size
        if len(token_ids) < len(pages) * ps:
            raise ValueError(
                f"{len(pages)} pages need {len(pages) * ps} tokens, got {len(token_ids)}"
            )
        if not self.enabled:
            self.allocator.free(pages)
            return InsertResult([], self.root, len(pages))
        tick = self._tick()
        node = self.root
        node.last_access = tick
        out: list[int] = []
        duplicates: list[int] = []
        pos = 0
        i = 0  # pages consumed
        while i < len(pages):
            child = node.children.get(tuple(token_ids[pos : pos + ps]))
            if child is None:
                leaf = RadixNode(list(token_ids[pos : len(pages) * ps]), list(pages[i:]), node)
                leaf.last_access = tick
                node.children[tuple(leaf.key[:ps])] = leaf
                self._num_pages += len(leaf.pages)
                self._num_evictable += len(leaf.pages)
                out.extend(leaf.pages)
                node = leaf
                break
            n = min(self._common_pages(child.key, token_ids, pos), len(pages) - i)
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = tick
            for mine, theirs in zip(pages[i : i + n], child.pages, strict=True):
                if mine != theirs:
                    duplicates.append(mine)
            out.extend(child.pages)
            pos += n * ps
            i += n
            node = child
        if duplicates:
            self.allocator.free(duplicates)
        return InsertResult(out, node, len(duplicates))

    # ---- locking ----------------------------------------------------------------------------
    def lock(self, node: RadixNode) -> None:
        """Pin the path root..node: none of its pages can be evicted until `unlock`."""
        while node.parent is not None:
            if node.ref == 0:
                self._num_evictable -= len(node.pages)
            node.ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node.parent is not None:
            if node.ref <= 0:
                raise RuntimeError(f"unlock of an unlocked node {node!r}")
            node.ref -= 1
            if node.ref == 0:
                self._num_evictable += len(node.pages)
            node = node.parent

    # ---- eviction ---------------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Free `num_pages` pages, or all evictable ones if fewer: least recently used unlocked
        leaves first. Returns the number freed.

        The last leaf may lose only its tail pages: a prefix of a cached sequence is still a
        valid cached sequence, and keeping it saves recomputing it later.
        """
        if num_pages <= 0 or self._num_evictable == 0:
            return 0
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            want = num_pages - freed
            if want < len(node.pages):
                self.allocator.free(node.pages[-want:])
                del node.pages[-want:]
                del node.key[-want * self.page_size :]
                self._num_pages -= want
                self._num_evictable -= want
                return num_pages
            self.allocator.free(node.pages)
            freed += len(node.pages)
            self._num_pages -= len(node.pages)
            self._num_evictable -= len(node.pages)
            parent = node.parent
            assert parent is not None
            del parent.children[tuple(node.key[: self.page_size])]
            if not parent.is_root and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def reset(self) -> int:
        """Evict everything; every node must be unlocked. Returns the pages freed."""
        if self.num_locked_pages:
            raise RuntimeError(f"reset with {self.num_locked_pages} locked pages")
        return self.evict(self._num_pages)

    # ---- introspection (tests, metrics) -----------------------------------------------------
    def nodes(self) -> list[RadixNode]:
        """Every node except the root, parents before children."""
        out: list[RadixNode] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def all_pages(self) -> list[int]:
        return [p for n in self.nodes() for p in n.pages]

    # ---- internals --------------------------------------------------------------------------
    def _tick(self) -> int:
        # A counter, not wall time: deterministic LRU order, and no ties within one call.
        self._clock += 1
        return self._clock

    def _leaves(self) -> list[RadixNode]:
        return [n for n in self.nodes() if not n.children]

    def _common_pages(self, key: list[int], token_ids: Sequence[int], pos: int) -> int:
        """Whole pages of `key` equal to token_ids[pos:] (the first page matched by lookup)."""
        ps = self.page_size
        n = 1
        limit = min(len(key), len(token_ids) - pos) // ps
        while n < limit and key[n * ps : (n + 1) * ps] == list(
            token_ids[pos + n * ps : pos + (n + 1) * ps]
        ):
            n += 1
        return n

    def _split(self, node: RadixNode, n: int) -> RadixNode:
        """Cut `node` after `n` pages; return the new upper node. The lower part stays the same
        object, so whoever holds (and locked) it still ends at the same place."""
        ps = self.page_size
        parent = node.parent
        assert parent is not None and 0 < n < len(node.pages)
        upper = RadixNode(node.key[: n * ps], node.pages[:n], parent)
        upper.ref = node.ref  # every lock through `node` passes through `upper`
        upper.last_access = node.last_access
        parent.children[tuple(upper.key[:ps])] = upper
        node.key = node.key[n * ps :]
        node.pages = node.pages[n:]
        node.parent = upper
        upper.children[tuple(node.key[:ps])] = node
        return upper
