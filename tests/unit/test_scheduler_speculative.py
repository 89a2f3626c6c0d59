"""The scheduler with draft tokens, without a model.

A fake target writes a fingerprint of each token's whole context into its KV slot (drafts
included, as a verify forward writes them) and checks every slot a sequence reads. So KV of a
rejected draft read as if it were an accepted token (a wrong rollback of the computed length,
or a prefix-cache page holding it) shows up as a read of the wrong context. Pages taken for
drafts must be back after the step: no leak, whatever was accepted.
"""

from __future__ import annotations

import random

from test_scheduler import EOS, check_invariants, fingerprints, make

from minisgl.sampling_params import SamplingParams
from minisgl.scheduler import Request, ScheduledBatch, Scheduler
from minisgl.speculative.verify import accept_run


def target(ids: list[int]) -> int:
    """The fake model's greedy next token: a function of the last two (so drafts copied from
    earlier in the sequence are often right)."""
    return (ids[-1] * 3 + (ids[-2] if len(ids) > 1 else 0)) % 5 + (EOS if ids[-1] == 4 else 1)


class FakeTarget:
    def __init__(self) -> None:
        self.kv: dict[tuple[int, int], int] = {}
        self.drafted = self.accepted = 0

    def run(self, batch: ScheduledBatch) -> list[list[int]]:
        ps = batch.page_size
        written: set[tuple[int, int]] = set()
        runs = []
        for seq in batch.seqs:
            ids = seq.req.all_ids
            pre, ext, pt = seq.start, len(seq.token_ids), seq.page_table
            ctx = ids[:pre] + seq.token_ids  # drafts appended to the request's tokens
            assert (
                seq.token_ids[: ext - len(seq.draft_ids)]
                == ids[pre : pre + ext - len(seq.draft_ids)]
            )
            assert len(pt) == -(-(pre + ext) // ps)
            fp = fingerprints(ctx)
            for q in range(pre):
                assert self.kv.get((pt[q // ps], q % ps)) == fp[q], (seq.req, q)
            for q in range(pre, pre + ext):
                slot = (pt[q // ps], q % ps)
                assert slot not in written, "two sequences write one KV slot"
                written.add(slot)
                self.kv[slot] = fp[q]
            if seq.sample:
                d = seq.draft_ids
                targets = [target(ctx[: len(ctx) - len(d) + j]) for j in range(len(d) + 1)]
                run = accept_run(d, targets)
                self.drafted += len(d)
                self.accepted += len(run) - 1
                runs.append(run)
        return runs


def proposer(rng: random.Random, s: Scheduler):
    def propose(reqs: list[Request]) -> list[list[int]]:
        out = []
        for r in reqs:
            ids = list(r.all_ids)
            good = rng.randint(0, 6)  # drafts the target will keep, then a wrong one
            for _ in range(good):
                ids.append(target(ids))
            draft = ids[r.num_tokens :] + [7] * rng.randint(0, 3)  # 7: never the target's
            out.append(draft[: rng.randint(0, 8)])
        return out

    return propose


def spec_step(s: Scheduler, eng: FakeTarget, propose) -> ScheduledBatch | None:
    batch = s.schedule(propose)
    if batch is None:
        return None
    s.process_batch_output(batch, eng.run(batch))
    check_invariants(s)
    for r in s.running:  # nothing held for drafts between steps
        assert len(r.page_table) <= -(-r.num_tokens // s.page_size)
    return batch


def greedy(prompt: list[int], max_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(target(ids))
        if ids[-1] == EOS:
            break
    return ids[len(prompt) :]


def test_random_workloads_with_drafts_keep_invariants_and_outputs() -> None:
    eng = FakeTarget()
    for seed in range(12):
        random_workload(seed, eng)
    # Both kinds happened: drafts kept and drafts rejected.
    assert eng.accepted > 20 and eng.drafted > eng.accepted + 20


def random_workload(seed: int, eng: FakeTarget) -> None:
    rng = random.Random(seed)
    s = make(
        num_pages=rng.randint(8, 24),
        page_size=rng.randint(1, 4),
        max_running_requests=rng.randint(1, 4),
        max_prefill_tokens=rng.randint(2, 16),
        max_seq_len=rng.randint(20, 48),
        enable_prefix_cache=seed % 3 != 0,
    )
    eng.kv.clear()
    base = [rng.randint(1, 3) for _ in range(12)]
    reqs = []
    for i in range(rng.randint(3, 8)):
        prompt = base[: rng.randint(0, 12)] + [rng.randint(1, 3) for _ in range(rng.randint(1, 6))]
        r = Request(f"q{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 16)))
        if s.check_prompt(len(prompt)) is not None:
            continue
        s.add_request(r)
        reqs.append(r)
    propose = proposer(rng, s)
    for _ in range(2_000):
        if spec_step(s, eng, propose) is None:
            break
    assert not s.has_unfinished()
    for r in reqs:  # drafts change how many steps, never which tokens
        want = greedy(r.prompt_ids, min(r.params.max_tokens, s.max_seq_len - len(r.prompt_ids)))
        assert r.output_ids == want[: len(r.output_ids)] and r.output_ids
        assert len(r.output_ids) <= r.params.max_tokens
    st_ = s.stats()
    assert st_.num_pages_used == 0 and st_.num_pages_free + st_.num_pages_cached == s.num_pages


def test_pages_taken_for_drafts_return_after_the_step() -> None:
    s = make(num_pages=16, page_size=2, enable_prefix_cache=False)
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=20))
    s.add_request(r)
    eng = FakeTarget()
    s.process_batch_output((b := s.schedule()), eng.run(b))  # prefill: 4 tokens, 2 pages
    assert s.allocator.num_free == 14
    batch = s.schedule(lambda reqs: [[9, 9, 9, 9, 9, 9]])  # all wrong: the target never says 9
    assert batch is not None and batch.seqs[0].draft_ids == [9] * 6
    assert s.allocator.num_free == 14 - 3  # room for 4 + 6 tokens: 5 pages
    s.process_batch_output(batch, eng.run(batch))
    assert r.num_tokens == 5 and r.num_computed == 4
    assert len(r.page_table) == 3 and s.allocator.num_free == 13


def test_drafts_never_run_past_max_tokens_or_the_context() -> None:
    s = make(num_pages=64, page_size=4, max_seq_len=12)
    a = Request("a", [1, 2], SamplingParams(max_tokens=4))
    b = Request("b", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=30))
    s.add_request(a)
    s.add_request(b)
    eng = FakeTarget()
    s.process_batch_output((batch := s.schedule()), eng.run(batch))
    batch = s.schedule(lambda reqs: [[7] * 10 for _ in reqs])
    assert batch is not None
    drafts = {q.req.rid: q.draft_ids for q in batch.seqs}
    assert len(drafts["a"]) == 4 - 1 - 1  # one output so far; the step emits drafts + 1
    assert len(drafts["b"]) == 12 - 9  # positions up to the context's end
