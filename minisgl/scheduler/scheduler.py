"""Continuous-batching scheduler: admission, chunked prefill, decode, preemption (torch-free).

Every `schedule()` builds one batch:
1. Running requests, oldest first, get room for the token(s) they compute this step. A decode
   may need a fresh page; when none is free (even after evicting unlocked prefix-cache pages),
   the NEWEST running request is preempted: its pages go back (its fully computed pages into
   the prefix cache, where a later recompute may find them), and it returns to the front of
   the waiting queue, to be recomputed from prompt + outputs when admitted again.
2. Decodes run one token each; partially prefilled requests continue first, in chunks, under
   the `max_prefill_tokens` budget (decodes do not count against it). A burst is prefilled a
   few requests per step when `soft_prefill_tokens` is set (the engine sizes it from its
   measured step costs: prefill_budget.py): a new request joins a step only while the step's
   prefill is below it, so the first requests of a burst get their first tokens after a short
   step, not after the whole burst's prefill; a request alone is never chunked by it.
3. Waiting requests are admitted in arrival order while budget, `max_running_requests` and
   pages allow: the longest whole-page cached prefix is reused (leaving at least one token to
   compute, so there are logits to sample), and pages for the whole remaining prefill are
   taken at admission, so a chunked prefill never stalls halfway for want of pages. Admission
   keeps one spare page per running request, so that admitting does not force a preemption
   on the very next decode step. The head of the queue blocks those behind it (no starvation).

Speculative decoding: `schedule(propose)` asks for draft tokens for the decoding requests (after
room for their own token is made, so drafts never cause a preemption), appends those that fit
(context, max_tokens, pages) to each decode, and takes pages for them; `process_batch_output`
then gets the run of tokens each request emits, and gives back at once the pages that only
rejected drafts used. KV of rejected drafts never reaches the prefix cache: only pages below
`num_computed` (accepted tokens) are ever inserted.

Samples of one prompt (n > 1) are added as a group: the first prefills, the others wait
(parked) until its prompt pages are in the prefix cache, and then reuse them, recomputing
at most the last partial page (all of it with --disable-prefix-cache). A request that scores its prompt (prompt logprobs) reuses no
cached page whose positions it has not scored yet: every prompt position gets its logits.

Requests that can never fit: `add_request` rejects a prompt that cannot be computed at all
(empty, >= max_seq_len tokens, or more KV than the whole pool). A request whose prompt fits but
whose output would outgrow the pool is finished with "length" once it holds as many tokens as
the pool can store (it is alone by then: older requests win preemption, so it makes progress).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from minisgl.kvcache.page_allocator import PageAllocator
from minisgl.kvcache.radix_cache import RadixCache
from minisgl.scheduler.batch import ScheduledBatch, ScheduledSeq
from minisgl.scheduler.request import Request

__all__ = ["ScheduledBatch", "ScheduledSeq", "Scheduler", "SchedulerStats"]


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_pages_total: int
    num_pages_free: int
    num_pages_used: int  # held by live requests (their own pages and the cached pages they lock)
    num_pages_cached: int  # held only by the prefix cache: evictable
    num_preemptions_total: int
    prefix_cache_hit_tokens_total: int
    prompt_tokens_total: int
    last_batch_size: int


class Scheduler:
    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        max_running_requests: int,
        max_prefill_tokens: int,
        max_seq_len: int,
        eos_token_ids: Iterable[int],
        enable_prefix_cache: bool = True,
    ) -> None:
        for name, value in (
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("max_running_requests", max_running_requests),
            ("max_prefill_tokens", max_prefill_tokens),
            ("max_seq_len", max_seq_len),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        # A burst's prefill in chunks (see prefill_budget.py): once a step has prefill work,
        # more waiting requests join it only while it has fewer than this many tokens (the
        # last one joins whole, up to max_prefill_tokens). None: max_prefill_tokens alone.
        self.soft_prefill_tokens: int | None = None
        self.max_seq_len = max_seq_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.capacity_tokens = num_pages * page_size
        self.allocator = PageAllocator(num_pages)
        self.cache = RadixCache(page_size, self.allocator, enabled=enable_prefix_cache)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is the newest
        self._live: dict[str, Request] = {}
        self._parked: dict[str, list[Request]] = {}  # leader rid -> its siblings, waiting
        self.num_preemptions_total = 0
        self.prefix_cache_hit_tokens_total = 0
        self.prompt_tokens_total = 0
        self.last_batch_size = 0
        # Called whenever a running request gives its pages back (finish, abort, preemption):
        # a drafter drops what it keeps for it.
        self.on_release: Callable[[Request], None] | None = None

    # ---- queue ------------------------------------------------------------------------------
    def check_prompt(self, num_prompt_tokens: int) -> str | None:
        """Why a prompt of this length can never run, or None if it can (for 400 errors)."""
        if num_prompt_tokens < 1:
            return "the prompt is empty"
        if num_prompt_tokens >= self.max_seq_len:
            return (
                f"the prompt has {num_prompt_tokens} tokens; the context is {self.max_seq_len} "
                "tokens and at least one must be left for the output"
            )
        if num_prompt_tokens > self.capacity_tokens:
            return (
                f"the prompt has {num_prompt_tokens} tokens but the KV cache holds "
                f"{self.capacity_tokens} ({self.num_pages} pages of {self.page_size})"
            )
        return None

    def add_request(self, req: Request) -> None:
        self._check_new(req)
        req.status = "waiting"
        self._live[req.rid] = req
        self.waiting.append(req)

    def add_group(self, reqs: list[Request]) -> None:
        """n samples of one prompt: reqs[0] prefills, the others reuse its cached prompt."""
        for req in reqs:
            self._check_new(req)
        self.add_request(reqs[0])
        # Even without a prefix cache they wait: the first sample's output (with the prompt's
        # logprobs) then always comes before any other sample's.
        for req in reqs[1:]:
            req.status = "parked"
            self._live[req.rid] = req
        if len(reqs) > 1:
            self._parked[reqs[0].rid] = list(reqs[1:])

    def _check_new(self, req: Request) -> None:
        if req.rid in self._live:
            raise ValueError(f"request id {req.rid!r} is already scheduled")
        if req.status != "new":
            raise ValueError(f"request {req.rid!r} was already added ({req.status})")
        problem = self.check_prompt(len(req.prompt_ids))
        if problem is not None:
            raise ValueError(problem)

    def _unpark(self, leader: Request) -> None:
        """The leader's prompt is cached (or it is gone): its siblings queue up, first in line
        (they arrived with it)."""
        for req in reversed(self._parked.pop(leader.rid, [])):
            if req.status == "parked":
                req.status = "waiting"
                self.waiting.appendleft(req)

    def abort_request(self, rid: str) -> Request | None:
        req = self._live.pop(rid, None)
        if req is None:
            return None
        if req.status == "waiting":
            self.waiting.remove(req)
        elif req.status == "parked":
            pass  # unparking skips it (no longer "parked")
        else:
            self.running.remove(req)
            self._release(req)
        req.finish_reason = "abort"
        req.status = "finished"
        self._unpark(req)
        return req

    def get_request(self, rid: str) -> Request | None:
        return self._live.get(rid)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_live(self) -> int:
        """Requests added and not yet finished or aborted (waiting + running, by id)."""
        return len(self._live)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_parked(self) -> int:
        return sum(r.status == "parked" for rs in self._parked.values() for r in rs)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + self.num_parked

    # ---- one step ---------------------------------------------------------------------------
    def schedule(
        self, propose: Callable[[list[Request]], Sequence[Sequence[int]]] | None = None
    ) -> ScheduledBatch | None:
        """One step's batch; `propose` (speculative decoding) gives draft tokens for the
        decoding requests, in the order given."""
        self._make_room_for_running()
        seqs: list[ScheduledSeq] = []
        budget = self.max_prefill_tokens
        decoding = [r for r in self.running if r.num_computed >= r.prefill_target]
        drafts: dict[int, Sequence[int]] = dict.fromkeys(map(id, decoding), ())
        if propose is not None and decoding:
            drafts.update(zip(map(id, decoding), propose(decoding), strict=True))
        for req in self.running:
            if req.num_computed >= req.prefill_target:  # decoding: one token, outside the budget
                seqs.append(self._decode_seq(req, drafts[id(req)]))
            elif budget > 0:  # a prefill admitted earlier continues before anything new
                n = min(req.num_remaining, budget)
                budget -= n
                seqs.append(self._seq(req, n, is_decode=False))
        soft = (
            self.max_prefill_tokens
            if self.soft_prefill_tokens is None
            else self.soft_prefill_tokens
        )
        while self.waiting and budget > 0 and len(self.running) < self.max_running_requests:
            if self.max_prefill_tokens - budget >= soft:
                break  # the rest of a burst waits for the next step; the first ones go first
            req = self.waiting[0]
            if not self._admit(req):
                break
            self.waiting.popleft()
            self.running.append(req)
            n = min(req.num_remaining, budget)
            budget -= n
            seqs.append(self._seq(req, n, is_decode=False))
        self.last_batch_size = len(seqs)
        if not seqs:
            return None
        return ScheduledBatch(seqs, self.page_size)

    def process_batch_output(
        self, batch: ScheduledBatch, next_token_ids: Sequence[int | Sequence[int]]
    ) -> list[Request]:
        """Apply a step's sampled tokens: one per sampled seq, or the run of tokens a seq with
        drafts emits (its accepted drafts, then the target's own token). A run is cut where
        the request finishes (a stop token, max_tokens, the context)."""
        num_samples = batch.num_samples
        if len(next_token_ids) != num_samples:
            raise ValueError(f"expected {num_samples} next tokens, got {len(next_token_ids)}")
        finished: list[Request] = []
        tokens = iter(next_token_ids)
        for seq in batch.seqs:
            out = next(tokens) if seq.sample else None
            run = None if out is None else list(out) if isinstance(out, Sequence) else [out]
            req = seq.req
            # Aborted (or otherwise moved) while the batch ran: its pages are already released.
            if req.status != "running" or req.num_computed != seq.start:
                continue
            req.num_computed = seq.start + len(seq.token_ids) - len(seq.draft_ids)
            if run is None:
                continue
            reason: str | None = None
            if req.params.max_tokens == 0:  # prompt scoring only: nothing is generated
                reason = "length"
            else:
                for i, token in enumerate(run):
                    # KV is in the cache for every token of the run but the last one taken.
                    req.num_computed = seq.start + len(seq.token_ids) - len(seq.draft_ids) + i
                    req.output_ids.append(int(token))
                    reason = self._finish_reason(req, int(token))
                    if reason is not None:
                        break
            if seq.draft_ids:
                self._drop_draft_pages(req)
            if reason is not None:
                self._finish(req, reason)
                finished.append(req)
            elif not seq.is_decode:
                self._cache_prefill(req)
            if not seq.is_decode:
                self._unpark(req)
        return finished

    def stats(self) -> SchedulerStats:
        free = self.allocator.num_free
        cached = self.cache.num_evictable_pages
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=self.num_waiting,
            num_pages_total=self.num_pages,
            num_pages_free=free,
            num_pages_used=self.num_pages - free - cached,
            num_pages_cached=cached,
            num_preemptions_total=self.num_preemptions_total,
            prefix_cache_hit_tokens_total=self.prefix_cache_hit_tokens_total,
            prompt_tokens_total=self.prompt_tokens_total,
            last_batch_size=self.last_batch_size,
        )

    # ---- pages ------------------------------------------------------------------------------
    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _alloc(self, n: int) -> list[int] | None:
        short = n - self.allocator.num_free
        if short > 0:
            self.cache.evict(short)
            if self.allocator.num_free < n:
                return None
        return self.allocator.alloc(n)

    def _ensure_room(self, req: Request, num_tokens: int) -> bool:
        need = self._pages_for(num_tokens) - len(req.page_table)
        if need <= 0:
            return True
        pages = self._alloc(need)
        if pages is None:
            return False
        req.page_table.extend(pages)
        return True

    def _make_room_for_running(self) -> None:
        """Give every running request room for all of all_ids, preempting from the newest."""
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if self._ensure_room(req, req.num_tokens):
                i += 1
                continue
            # Alone, a request always fits: it never holds more than the pool (see _finish_reason)
            # and no one else pins pages. So the victim list never runs dry before it reaches req.
            assert not (len(self.running) == 1 and self.running[0] is req), req
            self._preempt(self.running[-1])

    def _drop_draft_pages(self, req: Request) -> None:
        """Pages past what the request's tokens need held only rejected drafts' KV: back to
        the allocator now (never to the prefix cache)."""
        keep = self._pages_for(req.num_tokens)
        if len(req.page_table) > keep:
            self.allocator.free(req.page_table[keep:])
            del req.page_table[keep:]

    def _release(self, req: Request) -> None:
        """Give back a live request's pages: full computed pages to the prefix cache (shared
        with others, evictable once unlocked), the rest to the allocator."""
        if self.on_release is not None:
            self.on_release(req)
        if self.cache.enabled:
            full = req.num_computed // self.page_size
            assert full >= req.num_cached_pages, req
            self.cache.insert(req.token_slice(0, full * self.page_size), req.page_table[:full])
            if req.cache_node is not None:
                self.cache.unlock(req.cache_node)
            self.allocator.free(req.page_table[full:])
        else:
            self.allocator.free(req.page_table)
        req.page_table = []
        req.num_cached_pages = 0
        req.cache_node = None

    def _cache_prefill(self, req: Request) -> None:
        """Share a just-prefilled prompt with later requests while this one keeps running."""
        full = req.num_computed // self.page_size
        if not self.cache.enabled or full <= req.num_cached_pages:
            return
        res = self.cache.insert(req.token_slice(0, full * self.page_size), req.page_table[:full])
        # Lock the new end before unlocking the old one: it lies on the same path, below it.
        self.cache.lock(res.node)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node = res.node
        req.page_table[:full] = res.pages  # duplicates were freed: use the shared copies
        req.num_cached_pages = full

    # ---- transitions ------------------------------------------------------------------------
    def _admit(self, req: Request) -> bool:
        if self.cache.enabled:
            match = self.cache.match_prefix(req.token_slice(0, req.num_reusable))
        else:
            match = self.cache.match_prefix([])
        self.cache.lock(match.node)
        need = self._pages_for(req.num_tokens) - match.num_pages
        spare = len(self.running)
        if need + spare > self.allocator.num_free + self.cache.num_evictable_pages:
            self.cache.unlock(match.node)
            return False
        pages = self._alloc(need)
        assert pages is not None, "free + evictable pages were counted"
        req.page_table = match.pages + pages
        req.num_cached_pages = match.num_pages
        req.cache_node = match.node
        req.num_computed = match.num_pages * self.page_size
        req.prefill_target = req.num_tokens
        req.status = "running"
        if req.first_admit_time is None:
            req.first_admit_time = time.time()
            req.num_cached_tokens = req.num_computed
            self.prefix_cache_hit_tokens_total += req.num_computed
            self.prompt_tokens_total += len(req.prompt_ids)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed = 0
        req.prefill_target = 0
        req.status = "waiting"
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(req)

    def _finish_reason(self, req: Request, token: int) -> str | None:
        params = req.params
        if (
            token in self.eos_token_ids and not params.ignore_eos
        ) or token in params.stop_token_ids:
            return "stop"
        if (
            len(req.output_ids) >= params.max_tokens
            or req.num_tokens >= self.max_seq_len
            # The next step would need KV for num_tokens tokens: more than the whole pool.
            or req.num_tokens > self.capacity_tokens
        ):
            return "length"
        return None

    def _finish(self, req: Request, reason: str) -> None:
        self.running.remove(req)
        self._live.pop(req.rid, None)
        self._release(req)
        req.finish_reason = reason
        req.status = "finished"
        self._unpark(req)

    def _decode_seq(self, req: Request, drafts: Sequence[int]) -> ScheduledSeq:
        """A decode, with as many of `drafts` as fit: all emitted tokens within max_tokens and
        the context, and pages for their KV (taken now; evicting unlocked cached pages, but
        never preempting a request for a guess)."""
        params = req.params
        room = min(
            len(drafts),
            params.max_tokens - len(req.output_ids) - 1,  # the step emits up to drafts + 1
            min(self.max_seq_len, self.capacity_tokens) - req.num_tokens,
        )
        while room > 0 and not self._ensure_room(req, req.num_tokens + room):
            # Not enough pages for all: as many drafts as the pages already held, or none.
            room = min(room - 1, len(req.page_table) * self.page_size - req.num_tokens)
        seq = self._seq(req, 1, is_decode=True)
        if room > 0:
            seq.draft_ids = [int(t) for t in drafts[:room]]
            seq.token_ids = seq.token_ids + seq.draft_ids
            seq.page_table = req.page_table[: self._pages_for(seq.start + len(seq.token_ids))]
        return seq

    def _seq(self, req: Request, n: int, *, is_decode: bool) -> ScheduledSeq:
        start = req.num_computed
        end = start + n
        return ScheduledSeq(
            req=req,
            start=start,
            token_ids=req.token_slice(start, end),
            sample=end == req.num_tokens,
            page_table=req.page_table[: self._pages_for(end)],
            is_decode=is_decode,
        )
