"""Scheduler policy without a model.

A fake engine stands in for the model: it writes a fingerprint of each token's whole context
into that token's KV slot (page, offset) and, on every step, checks each slot a sequence
attends to. So any page shared, deduplicated, evicted or reused wrongly shows up as a KV read
of the wrong context, exactly what would corrupt a real model's output.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.kvcache import RadixNode
from minisgl.sampling_params import SamplingParams
from minisgl.scheduler import Request, ScheduledBatch, Scheduler

EOS = 0


def fingerprints(ids: list[int]) -> list[int]:
    out, h = [], 0
    for t in ids:
        h = hash((h, t))
        out.append(h)
    return out


class FakeEngine:
    def __init__(self, next_token: Callable[[Request], int] | None = None) -> None:
        self.kv: dict[tuple[int, int], int] = {}
        self.next_token = next_token or (lambda req: 10 + len(req.output_ids) % 5)
        self.steps = 0

    def run(self, batch: ScheduledBatch) -> list[int]:
        ps = batch.page_size
        prefix_lens, extend_lens, page_tables = batch.layout_lists()
        slots_written: set[tuple[int, int]] = set()
        out = []
        for seq, pre, ext, pt in zip(
            batch.seqs, prefix_lens, extend_lens, page_tables, strict=True
        ):
            ids = seq.req.all_ids
            assert ext >= 1 and seq.token_ids == ids[pre : pre + ext]
            assert seq.sample == (pre + ext == len(ids))
            assert len(pt) == -(-(pre + ext) // ps)
            fp = fingerprints(ids[: pre + ext])
            for q in range(pre):
                assert self.kv.get((pt[q // ps], q % ps)) == fp[q], (seq.req, q)
            for q in range(pre, pre + ext):
                slot = (pt[q // ps], q % ps)
                assert slot not in slots_written, "two sequences write one KV slot"
                slots_written.add(slot)
                self.kv[slot] = fp[q]
            if seq.sample:
                out.append(self.next_token(seq.req))
        self.steps += 1
        return out


def make(**kw) -> Scheduler:
    args = dict(
        num_pages=64,
        page_size=4,
        max_running_requests=8,
        max_prefill_tokens=64,
        max_seq_len=1024,
        eos_token_ids=[EOS],
        enable_prefix_cache=True,
    )
    args.update(kw)
    return Scheduler(**args)  # type: ignore[arg-type]


_rid = itertools.count()


def req(prompt: list[int] | int, max_tokens: int = 4, **params) -> Request:
    """A request; an int prompt means that many tokens no other request's prompt shares."""
    n = next(_rid)
    ids = [1000 * (n + 1) + i for i in range(prompt)] if isinstance(prompt, int) else prompt
    return Request(f"r{n}", ids, SamplingParams(max_tokens=max_tokens, **params))


def maybe_step(s: Scheduler, eng: FakeEngine) -> tuple[ScheduledBatch | None, list[Request]]:
    batch = s.schedule()
    if batch is None:
        return None, []
    finished = s.process_batch_output(batch, eng.run(batch))
    check_invariants(s)
    return batch, finished


def step(s: Scheduler, eng: FakeEngine) -> tuple[ScheduledBatch, list[Request]]:
    batch, finished = maybe_step(s, eng)
    assert batch is not None, "the scheduler idled with work queued"
    return batch, finished


def run_all(s: Scheduler, eng: FakeEngine, max_steps: int = 10_000) -> list[ScheduledBatch]:
    batches = []
    for _ in range(max_steps):
        batch, _ = maybe_step(s, eng)
        if batch is None:
            break
        batches.append(batch)
    assert not s.has_unfinished()
    return batches


def path_pages(node: RadixNode | None) -> list[int]:
    pages: list[int] = []
    while node is not None:
        pages[:0] = node.pages
        node = node.parent
    return pages


def check_invariants(s: Scheduler) -> None:
    """Every page is exactly one of: free, a live request's own, or in the prefix cache."""
    alloc, cache = s.allocator, s.cache
    free = list(alloc._free)
    tree = cache.all_pages()
    own: list[int] = []
    for r in s.running:
        assert r.status == "running" and not r.is_finished
        assert r.num_computed <= r.num_tokens
        assert len(r.page_table) * s.page_size >= r.num_computed
        shared = r.page_table[: r.num_cached_pages]
        assert path_pages(r.cache_node) == shared
        assert len(shared) * s.page_size <= r.num_computed
        own.extend(r.page_table[r.num_cached_pages :])
    for r in s.waiting:
        assert r.status == "waiting" and r.page_table == [] and r.num_computed == 0
        assert r.cache_node is None
    everything = free + tree + own
    assert len(everything) == len(set(everything)) == s.num_pages, "page leaked or double-held"
    assert all(alloc.is_allocated(p) for p in tree + own)
    # Lock counts: one per running request whose locked node lies at or below the node.
    for node in cache.nodes():
        holders = 0
        for r in s.running:
            cur = r.cache_node
            while cur is not None and cur is not node:
                cur = cur.parent
            holders += cur is node
        assert node.ref == holders
    st_ = s.stats()
    locked = sum(len(n.pages) for n in cache.nodes() if n.ref > 0)
    assert st_.num_pages_free == len(free)
    assert st_.num_pages_used == len(own) + locked
    assert st_.num_pages_cached == len(tree) - locked
    assert st_.num_pages_free + st_.num_pages_used + st_.num_pages_cached == s.num_pages
    assert st_.num_running == len(s.running) <= s.max_running_requests
    if not s.cache.enabled:
        assert tree == []


# ---- chunked prefill, mixing, admission ---------------------------------------------------


def test_long_prompt_is_prefilled_in_chunks_then_decoded() -> None:
    s, eng = make(max_prefill_tokens=32), FakeEngine()
    r = req(100, max_tokens=3)
    s.add_request(r)
    batches = run_all(s, eng)
    shape = [(b.seqs[0].start, len(b.seqs[0].token_ids), b.seqs[0].sample) for b in batches]
    assert shape == [(0, 32, False), (32, 32, False), (64, 32, False), (96, 4, True)] + [
        (100, 1, True),
        (101, 1, True),
    ]
    assert [b.num_decode for b in batches] == [0, 0, 0, 0, 1, 1]
    assert r.finish_reason == "length" and len(r.output_ids) == 3


def test_decodes_and_prefill_chunks_share_a_step_and_partial_prefill_goes_first() -> None:
    s, eng = make(max_prefill_tokens=16), FakeEngine()
    a = req(8, max_tokens=10)
    s.add_request(a)
    step(s, eng)  # a prefilled
    b = req(40, max_tokens=2)
    s.add_request(b)
    batch, _ = step(s, eng)
    assert [(x.req, len(x.token_ids), x.is_decode) for x in batch.seqs] == [
        (a, 1, True),
        (b, 16, False),
    ]
    assert batch.num_tokens == 17 and batch.num_prefill_tokens == 16  # decodes are off-budget
    c = req(4, max_tokens=2)
    s.add_request(c)
    batch, _ = step(s, eng)  # b's second chunk takes the whole budget: c waits
    assert [x.req for x in batch.seqs] == [a, b] and s.num_waiting == 1
    batch, _ = step(s, eng)  # b's last 8 tokens first, then c is admitted with what is left
    assert [(x.req, x.start, len(x.token_ids)) for x in batch.seqs] == [
        (a, 10, 1),
        (b, 32, 8),
        (c, 0, 4),
    ]
    assert all(batch.num_prefill_tokens <= 16 for batch in run_all(s, eng))


def test_max_running_requests_caps_the_batch_and_others_join_as_requests_leave() -> None:
    s, eng = make(max_running_requests=2), FakeEngine()
    rs = [req(4, max_tokens=3) for _ in range(5)]
    for r in rs:
        s.add_request(r)
    batch, _ = step(s, eng)
    assert [x.req for x in batch.seqs] == rs[:2] and s.num_waiting == 3
    batches = [batch, *run_all(s, eng)]
    assert max(len(b.seqs) for b in batches) == 2
    # As soon as the first two finish, the next two are admitted: no idle step.
    assert [x.req for x in batches[3].seqs] == rs[2:4]
    assert all(r.finish_reason == "length" and len(r.output_ids) == 3 for r in rs)


def test_admission_waits_for_pages_and_evicts_cached_prefixes_when_needed() -> None:
    s, eng = make(num_pages=6, page_size=4), FakeEngine()
    a = req(list(range(1, 17)), max_tokens=4)  # 16 tokens: 4 pages
    b = req(list(range(50, 62)), max_tokens=2)  # 12 tokens: 3 pages + 1 spare for a > 2 free
    s.add_request(a)
    s.add_request(b)
    batch, _ = step(s, eng)
    assert [x.req for x in batch.seqs] == [a] and b.status == "waiting"
    while a.status == "running":
        step(s, eng)
    assert s.stats().num_pages_cached == 4  # a's full pages, kept for reuse
    batch, _ = step(s, eng)
    assert [x.req for x in batch.seqs] == [b]
    assert s.stats().num_pages_cached == 3  # only the page b lacked was evicted (a's tail)
    run_all(s, eng)
    assert b.finish_reason == "length"


# ---- preemption ---------------------------------------------------------------------------


def _preemption_setup(enable_prefix_cache: bool):
    # 7 pages of 2 tokens. a decodes and crosses page boundaries; c arrives later with a long
    # chunked prompt and becomes the newest: when a needs a page and none is free, c goes.
    s = make(
        num_pages=7, page_size=2, max_prefill_tokens=2, enable_prefix_cache=enable_prefix_cache
    )
    eng = FakeEngine()
    a = req([1, 2], max_tokens=7)
    c = req(list(range(21, 29)), max_tokens=3)
    s.add_request(a)
    step(s, eng)
    s.add_request(c)
    preempted_at = None
    recompute = None
    for i in range(100):
        was_running = c.status == "running"
        batch, _ = maybe_step(s, eng)
        if batch is None:
            break
        if preempted_at is None and was_running and c.status == "waiting":
            preempted_at = (i, list(c.all_ids), a.status)
        elif preempted_at is not None and recompute is None:
            recompute = next((x for x in batch.seqs if x.req is c), None)
    return s, a, c, preempted_at, recompute


def test_out_of_pages_preempts_the_newest_which_recomputes_prompt_and_outputs() -> None:
    s, a, c, preempted_at, recompute = _preemption_setup(enable_prefix_cache=False)
    assert preempted_at is not None
    _, ids_at_preemption, a_status = preempted_at
    assert a_status == "running" and a.num_preemptions == 0
    assert c.num_preemptions == 1 and s.stats().num_preemptions_total == 1
    assert len(ids_at_preemption) > len(c.prompt_ids)  # it had produced output already
    assert recompute is not None and recompute.start == 0
    assert recompute.token_ids == ids_at_preemption[: len(recompute.token_ids)]
    assert a.finish_reason == c.finish_reason == "length"
    assert len(a.output_ids) == 7 and len(c.output_ids) == 3
    assert s.stats().num_pages_free == 7


def test_preempted_request_reuses_its_cached_pages_when_readmitted() -> None:
    s, a, c, preempted_at, recompute = _preemption_setup(enable_prefix_cache=True)
    assert preempted_at is not None and c.num_preemptions == 1
    _, ids_at_preemption, _ = preempted_at
    # Its 4 fully computed pages went into the prefix cache; a's next page cost the tail one
    # (LRU eviction trims leaves page by page), so 3 pages (6 tokens) are reused.
    assert recompute is not None and recompute.start == 6
    assert recompute.token_ids == ids_at_preemption[6:8]
    assert c.num_cached_tokens == 0  # metrics count hits at first admission only
    assert len(c.output_ids) == 3


def test_request_that_outgrows_the_pool_finishes_with_length_and_others_still_run() -> None:
    s, eng = make(num_pages=3, page_size=2), FakeEngine()  # room for 6 tokens in all
    big = req(4, max_tokens=100)
    small = req(2, max_tokens=2)
    s.add_request(big)
    s.add_request(small)
    run_all(s, eng, max_steps=200)
    assert big.finish_reason == "length" and big.num_tokens == 7  # KV for 6: all the pool
    assert small.finish_reason == "length" and len(small.output_ids) == 2


@pytest.mark.parametrize(
    ("prompt_len", "fragment"),
    [(0, "empty"), (40, "context"), (13, "KV cache holds 12")],
)
def test_prompts_that_can_never_run_are_rejected_with_a_reason(prompt_len, fragment) -> None:
    s = make(num_pages=3, page_size=4, max_seq_len=40)
    assert fragment in (s.check_prompt(prompt_len) or "")
    with pytest.raises(ValueError, match=fragment):
        s.add_request(Request("x", list(range(1, prompt_len + 1)), SamplingParams()))
    assert not s.has_unfinished() and s.check_prompt(12) is None


# ---- abort --------------------------------------------------------------------------------


def test_abort_waiting_request() -> None:
    s = make()
    r = req(8)
    s.add_request(r)
    assert s.abort_request(r.rid) is r
    assert r.finish_reason == "abort" and r.is_finished and s.num_waiting == 0
    assert s.abort_request(r.rid) is None and s.abort_request("nope") is None
    assert s.schedule() is None


@pytest.mark.parametrize("when", ["mid-prefill", "decoding", "preempted", "in-flight"])
def test_abort_releases_every_page(when: str) -> None:
    s, eng = make(num_pages=7, page_size=2, max_prefill_tokens=2), FakeEngine()
    other = req([1, 2], max_tokens=7)
    r = req(list(range(21, 29)), max_tokens=5)
    s.add_request(other)
    step(s, eng)
    s.add_request(r)
    step(s, eng)
    if when == "decoding":
        while r.num_computed < r.prefill_target:
            step(s, eng)
        assert r.output_ids
    elif when == "preempted":
        while r.num_preemptions == 0:
            step(s, eng)
        assert r.status == "waiting"
    if when == "in-flight":
        batch = s.schedule()
        assert batch is not None and r in [x.req for x in batch.seqs]
        tokens = eng.run(batch)
        n_other, n_r = len(other.output_ids), len(r.output_ids)
        assert s.abort_request(r.rid) is r
        s.process_batch_output(batch, tokens)  # r's token is dropped; other's is kept
        assert len(other.output_ids) == n_other + 1 and len(r.output_ids) == n_r
    else:
        assert r.status in ("running", "waiting")
        assert s.abort_request(r.rid) is r
    check_invariants(s)
    assert r.finish_reason == "abort" and r.page_table == []
    assert r not in s.running and r not in s.waiting
    run_all(s, eng)
    assert other.finish_reason == "length"
    st_ = s.stats()
    assert st_.num_pages_used == 0 and st_.num_pages_free + st_.num_pages_cached == 7


def test_abort_keeps_a_shared_prefix_cached_for_its_other_users() -> None:
    s, eng = make(), FakeEngine()
    prefix = list(range(1, 17))
    a = req(prefix + [90], max_tokens=6)
    s.add_request(a)
    step(s, eng)
    b = req(prefix + [91, 92], max_tokens=6)
    s.add_request(b)
    step(s, eng)
    assert b.page_table[:4] == a.page_table[:4]
    s.abort_request(a.rid)
    check_invariants(s)
    run_all(s, eng)  # the fake engine checks that b still reads the right KV
    assert b.finish_reason == "length" and len(b.output_ids) == 6


# ---- prefix cache -------------------------------------------------------------------------


def test_running_request_shares_its_prompt_prefix_with_later_ones() -> None:
    s, eng = make(), FakeEngine()
    prefix = list(range(1, 17))  # 4 pages
    a = req(prefix + [90, 91, 92], max_tokens=8)
    s.add_request(a)
    step(s, eng)  # a's prefill completes: its 4 full pages enter the cache while it runs
    b = req(prefix + [80, 81, 82], max_tokens=3)
    s.add_request(b)
    batch, _ = step(s, eng)
    seq_b = next(x for x in batch.seqs if x.req is b)
    assert seq_b.start == 16 and seq_b.token_ids == [80, 81, 82]
    assert b.page_table[:4] == a.page_table[:4]
    assert b.num_cached_tokens == 16
    assert s.stats().prefix_cache_hit_tokens_total == 16
    assert s.stats().prompt_tokens_total == 38
    run_all(s, eng)
    assert a.finish_reason == b.finish_reason == "length"


def test_same_prefix_computed_twice_at_once_is_deduplicated() -> None:
    s, eng = make(num_pages=16), FakeEngine()
    prefix = list(range(1, 17))
    a = req(prefix + [90], max_tokens=5)
    b = req(prefix + [80], max_tokens=5)
    s.add_request(a)
    s.add_request(b)
    batch = s.schedule()
    assert batch is not None and [x.start for x in batch.seqs] == [0, 0]
    assert set(a.page_table).isdisjoint(b.page_table)
    free_before = s.allocator.num_free
    s.process_batch_output(batch, eng.run(batch))
    check_invariants(s)
    assert b.page_table[:4] == a.page_table[:4]  # b now reads a's copy
    assert s.allocator.num_free == free_before + 4  # b's duplicate pages went back
    run_all(s, eng)  # the fake engine checks every KV read against its context


def test_identical_prompt_leaves_at_least_one_token_to_compute() -> None:
    s, eng = make(), FakeEngine()
    prompt = list(range(1, 17))  # exactly 4 pages
    first = req(prompt, max_tokens=2)
    s.add_request(first)
    run_all(s, eng)
    again = req(prompt, max_tokens=2)
    s.add_request(again)
    batch, _ = step(s, eng)
    assert batch.seqs[0].start == 12 and batch.seqs[0].token_ids == prompt[12:]
    longer = req(prompt + [5], max_tokens=2)
    s.add_request(longer)
    batch, _ = step(s, eng)
    assert next(x for x in batch.seqs if x.req is longer).start == 16


def test_generated_tokens_are_cached_for_a_follow_up_turn() -> None:
    s, eng = make(), FakeEngine()
    a = req(list(range(1, 11)), max_tokens=8)
    s.add_request(a)
    run_all(s, eng)
    follow_up = req(a.all_ids + [77, 78], max_tokens=1)  # chat: previous turn + new message
    s.add_request(follow_up)
    batch, _ = step(s, eng)
    # a computed KV for 17 of its 18 tokens: 4 full pages are reusable.
    assert batch.seqs[0].start == 16


def test_prefix_cache_disabled_shares_nothing_and_frees_everything() -> None:
    s, eng = make(enable_prefix_cache=False), FakeEngine()
    prefix = list(range(1, 17))
    a = req(prefix + [90], max_tokens=6)
    s.add_request(a)
    step(s, eng)
    b = req(prefix + [80], max_tokens=3)
    s.add_request(b)
    batch, _ = step(s, eng)
    assert next(x for x in batch.seqs if x.req is b).start == 0
    assert set(a.page_table).isdisjoint(b.page_table)
    run_all(s, eng)
    st_ = s.stats()
    assert st_.num_pages_cached == 0 and st_.num_pages_free == 64
    assert st_.prefix_cache_hit_tokens_total == 0


# ---- finishing ----------------------------------------------------------------------------


def scripted(tokens: list[int]) -> FakeEngine:
    return FakeEngine(lambda r: tokens[len(r.output_ids)])


def test_eos_stops_unless_ignored() -> None:
    s = make()
    r = req(4, max_tokens=10)
    s.add_request(r)
    run_all(s, scripted([5, 6, EOS, 7, 8]))
    assert r.finish_reason == "stop" and r.output_ids == [5, 6, EOS]
    s = make()
    r = req(4, max_tokens=4, ignore_eos=True)
    s.add_request(r)
    run_all(s, scripted([5, EOS, 6, 7]))
    assert r.finish_reason == "length" and r.output_ids == [5, EOS, 6, 7]


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    s = make(eos_token_ids=[EOS, 1000])
    r = req(4, max_tokens=10, ignore_eos=True, stop_token_ids=[42])
    s.add_request(r)
    run_all(s, scripted([5, 1000, 42, 7]))
    assert r.finish_reason == "stop" and r.output_ids == [5, 1000, 42]


def test_context_limit_finishes_with_length() -> None:
    s = make(max_seq_len=8)
    r = req(5, max_tokens=100)
    s.add_request(r)
    run_all(s, FakeEngine())
    assert r.finish_reason == "length" and r.num_tokens == 8


def test_max_tokens_one_finishes_at_prefill_and_caches_the_prompt() -> None:
    s = make()
    r = req(9, max_tokens=1)
    s.add_request(r)
    batches = run_all(s, FakeEngine())
    assert len(batches) == 1 and r.finish_reason == "length" and len(r.output_ids) == 1
    assert s.stats().num_pages_cached == 2  # 9 computed tokens: 2 full pages


# ---- interface details --------------------------------------------------------------------


def test_layout_lists_describe_the_step() -> None:
    s, eng = make(page_size=4, max_prefill_tokens=6), FakeEngine()
    a, b = req(3, max_tokens=5), req(10, max_tokens=5)
    s.add_request(a)
    s.add_request(b)
    batch = s.schedule()
    assert batch is not None
    prefix_lens, extend_lens, page_tables = batch.layout_lists()
    assert prefix_lens == [0, 0] and extend_lens == [3, 3]
    assert [len(p) for p in page_tables] == [1, 1]
    assert batch.num_tokens == 6 and batch.num_prefill == 2 and batch.num_decode == 0
    s.process_batch_output(batch, eng.run(batch))
    batch = s.schedule()
    assert batch is not None
    assert batch.layout_lists()[:2] == ([3, 3], [1, 6])
    assert [len(p) for p in batch.layout_lists()[2]] == [1, 3]


def test_bad_calls_are_refused() -> None:
    s, eng = make(), FakeEngine()
    r = req(4)
    s.add_request(r)
    with pytest.raises(ValueError):
        s.add_request(r)
    batch = s.schedule()
    assert batch is not None
    with pytest.raises(ValueError):
        s.process_batch_output(batch, [])
    s.process_batch_output(batch, eng.run(batch))
    with pytest.raises(ValueError):
        make(max_prefill_tokens=0)


def test_stats_report_the_queue() -> None:
    s, eng = make(max_running_requests=1), FakeEngine()
    for _ in range(3):
        s.add_request(req(4, max_tokens=2))
    step(s, eng)
    st_ = s.stats()
    assert (st_.num_running, st_.num_waiting, st_.last_batch_size) == (1, 2, 1)
    assert st_.num_pages_used == 1 and st_.num_pages_total == 64  # 4 tokens: one page
    assert s.has_unfinished() and s.num_running == 1 and s.num_waiting == 2


# ---- property test: random operations -----------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), enable_prefix_cache=st.booleans())
def test_random_workloads_keep_every_invariant(seed: int, enable_prefix_cache: bool) -> None:
    # A seeded generator picks pool, limits and workload: hypothesis favours tiny values, which
    # here means a pool too small for any prompt and an idle scheduler. Prompts come from a
    # tiny alphabet and often share a prefix, so the prefix cache hits; generated tokens are
    # mostly non-EOS (0), so requests live long enough to be preempted and aborted.
    rng = random.Random(seed)
    s = make(
        num_pages=rng.randint(2, 12),
        page_size=rng.randint(1, 3),
        max_running_requests=rng.randint(1, 4),
        max_prefill_tokens=rng.randint(1, 12),
        max_seq_len=rng.randint(6, 40),
        enable_prefix_cache=enable_prefix_cache,
    )
    longest = min(s.capacity_tokens, s.max_seq_len - 1) + 1  # one past: sometimes rejected
    eng = FakeEngine(lambda r: rng.choice((EOS, 1, 2, 2, 3, 3, 3, 3, 3, 3)))
    base = [rng.randint(1, 2) for _ in range(longest)]
    added: list[Request] = []
    for _ in range(rng.randint(20, 60)):
        op = rng.random()
        if op < 0.3 and len(added) < 12:
            n = rng.randint(1, longest)
            shared = rng.randint(0, n)
            prompt = base[:shared] + [rng.randint(1, 3) for _ in range(n - shared)]
            r = Request(
                f"q{len(added)}",
                prompt,
                SamplingParams(max_tokens=rng.randint(1, 10), ignore_eos=rng.random() < 0.5),
            )
            if s.check_prompt(len(prompt)) is not None:
                with pytest.raises(ValueError):
                    s.add_request(r)
                continue
            s.add_request(r)
            added.append(r)
        elif op < 0.4 and added:
            victim = rng.choice(added)
            was_live = not victim.is_finished
            assert (s.abort_request(victim.rid) is victim) == was_live
        else:
            had_work = s.has_unfinished()
            batch, _ = maybe_step(s, eng)
            assert (batch is None) == (not had_work)  # never idle while work is queued
        check_invariants(s)
    run_all(s, eng, max_steps=5_000)
    for r in added:
        assert r.finish_reason in ("stop", "length", "abort")
        assert len(r.output_ids) <= r.params.max_tokens
        assert r.num_tokens <= s.max_seq_len
        if r.finish_reason == "stop":
            assert r.output_ids[-1] == EOS and not r.params.ignore_eos
        if r.finish_reason == "length":
            assert EOS not in r.output_ids or r.params.ignore_eos
    st_ = s.stats()
    assert st_.num_pages_used == 0 and st_.num_pages_free + st_.num_pages_cached == s.num_pages


# ---- samples of one prompt, prompt scoring -------------------------------------------------


def group(prompt: list[int], n: int, max_tokens: int = 4) -> list[Request]:
    base = f"g{next(_rid)}"
    params = SamplingParams(max_tokens=max_tokens)
    return [Request(f"{base}#{i}", prompt, params, group=base, index=i) for i in range(n)]


def test_samples_wait_for_the_first_prefill_then_share_its_pages() -> None:
    s, eng = make(max_prefill_tokens=8), FakeEngine()
    prompt = list(range(100, 122))  # 22 tokens: 5 full pages of 4, and 2 more
    reqs = group(prompt, 3)
    s.add_group(reqs)
    assert s.num_waiting == 3 and [r.status for r in reqs] == ["waiting", "parked", "parked"]
    while reqs[0].num_computed < len(prompt):
        batch, _ = step(s, eng)
        assert all(seq.req is reqs[0] for seq in batch.seqs)  # siblings stay parked
    batch, _ = step(s, eng)
    siblings = [seq for seq in batch.seqs if seq.req is not reqs[0]]
    # Each sibling reuses the 5 cached pages and computes only the last partial page.
    assert [(seq.start, len(seq.token_ids)) for seq in siblings] == [(20, 2), (20, 2)]
    assert s.prefix_cache_hit_tokens_total == 40
    run_all(s, eng)
    assert all(r.finish_reason == "length" and len(r.output_ids) == 4 for r in reqs)
    assert s.num_live == 0


def test_aborting_a_parked_sample_or_the_first_one() -> None:
    s, eng = make(), FakeEngine()
    reqs = group(list(range(200, 230)), 3)
    s.add_group(reqs)
    assert s.abort_request(reqs[2].rid) is reqs[2] and s.num_waiting == 2
    assert s.abort_request(reqs[0].rid) is reqs[0]  # before its prefill: the rest go on
    assert reqs[1].status == "waiting"
    run_all(s, eng)
    assert reqs[1].finish_reason == "length" and reqs[2].finish_reason == "abort"
    assert s.num_live == 0 and s.num_waiting == 0


def test_prompt_scoring_recomputes_cached_positions_it_has_not_scored() -> None:
    s, eng = make(), FakeEngine()
    prompt = list(range(300, 340))
    s.add_request(Request("warm", prompt + [1], SamplingParams(max_tokens=1)))
    run_all(s, eng)
    scorer = Request("score", prompt + [2], SamplingParams(max_tokens=1, prompt_logprobs=1))
    s.add_request(scorer)
    batch, _ = step(s, eng)
    assert batch.seqs[0].start == 0  # the cached 40 tokens are recomputed: logits needed
    # Its prefill still fills the cache for everyone else.
    plain = Request("plain", prompt + [3], SamplingParams(max_tokens=1))
    s.add_request(plain)
    batch, _ = step(s, eng)
    assert batch.seqs[0].start == 40


def test_max_tokens_zero_finishes_after_the_prefill_with_no_token() -> None:
    s, eng = make(), FakeEngine()
    r = Request("z", list(range(400, 410)), SamplingParams(max_tokens=0, prompt_logprobs=0))
    s.add_request(r)
    run_all(s, eng)
    assert r.finish_reason == "length" and r.output_ids == [] and s.num_live == 0


def test_a_preempted_request_reuses_cached_pages_of_its_outputs_too() -> None:
    s, eng = make(), FakeEngine()
    r = req(6, max_tokens=20)
    s.add_request(r)
    for _ in range(12):  # prefill + 11 decodes: 17 tokens computed, 4 full pages
        step(s, eng)
    s._preempt(r)
    batch, _ = step(s, eng)
    assert batch.seqs[0].start == 16  # all four full pages, beyond the 6 prompt tokens
