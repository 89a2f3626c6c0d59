"""Offline: logprobs, prompt logprobs, n samples and penalties, checked against transformers.

Every log-probability must equal transformers' log_softmax of the same fixture model's fp32
logits (1e-4), whatever the batch, the prefix cache or prefill chunking did.
"""

from __future__ import annotations

import dataclasses
import random
from functools import lru_cache

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.logprobs import TokenLogprobs

TOL = 1e-4


@lru_cache(maxsize=2)
def _hf(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logsoftmax(model_dir: str, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row p is the distribution of the token after position p."""
    with torch.inference_mode():
        logits = _hf(model_dir)(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_entries(lsm: torch.Tensor, positions: list[int], lp: TokenLogprobs, k: int) -> None:
    """Entry j scores token lp.token_ids[j] with the distribution at positions[j]."""
    assert len(lp) == len(positions)
    for j, pos in enumerate(positions):
        want = float(lsm[pos, lp.token_ids[j]])
        got = lp.logprobs[j]
        assert got is not None and abs(got - want) < TOL, (j, got, want)
        values, ids = lsm[pos].topk(k)
        assert len(lp.top_ids[j]) == k
        for tid, tv, wv in zip(lp.top_ids[j], lp.top_logprobs[j], values.tolist(), strict=True):
            assert abs(tv - wv) < TOL and abs(float(lsm[pos, tid]) - tv) < TOL


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(0, 151643) for _ in range(n)]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> str:
    return str(tiny_model_dir)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    # A small prefill budget: prompts beyond 40 tokens are prefilled in chunks.
    return LLM(model_dir, dtype="float32", device="cpu", num_pages=512, max_prefill_tokens=40)


@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_generated_logprobs_match_transformers(model_dir, llm, temperature):
    rng = random.Random(1)
    prompts = [_prompt(rng, n) for n in (5, 23, 90)]
    params = SamplingParams(temperature=temperature, top_k=50, seed=3, max_tokens=6, logprobs=5)
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        full = prompt + out.token_ids
        lsm = hf_logsoftmax(model_dir, full)
        assert out.logprobs is not None and out.logprobs.token_ids == out.token_ids
        check_entries(lsm, list(range(len(prompt) - 1, len(full) - 1)), out.logprobs, 5)


def test_prompt_logprobs_with_cache_hits_and_chunks(model_dir, llm):
    rng = random.Random(2)
    shared = _prompt(rng, 70)
    llm.generate([shared + _prompt(rng, 3)], SamplingParams(max_tokens=2))  # cache the prefix
    hits_before = llm.engine.stats().prefix_cache_hit_tokens_total
    prompts = [shared + _prompt(rng, 30), _prompt(rng, 130), _prompt(rng, 1), _prompt(rng, 16)]
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=3)
    )
    for prompt, out in zip(prompts, outs, strict=True):
        lp = out.prompt_logprobs
        assert lp is not None and lp.token_ids == prompt and lp.logprobs[0] is None
        lsm = hf_logsoftmax(model_dir, prompt + out.token_ids)
        rest = TokenLogprobs(lp.token_ids[1:], lp.logprobs[1:], lp.top_ids[1:], lp.top_logprobs[1:])
        check_entries(lsm, list(range(len(prompt) - 1)), rest, 3)
        check_entries(lsm, list(range(len(prompt) - 1, len(prompt) + 2)), out.logprobs, 2)
    # The cached prefix was there, and scoring still gave every position (no holes): a later
    # plain request does reuse what the scoring request computed.
    assert llm.engine.stats().prefix_cache_hit_tokens_total == hits_before
    llm.generate([prompts[1] + [5]], SamplingParams(max_tokens=1))
    assert llm.engine.stats().prefix_cache_hit_tokens_total > hits_before


def test_max_tokens_zero_scores_the_prompt_only(model_dir, llm):
    prompt = _prompt(random.Random(3), 50)
    out = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert out.token_ids == [] and out.finish_reason == "length"
    lsm = hf_logsoftmax(model_dir, prompt)
    want = [float(lsm[p, prompt[p + 1]]) for p in range(len(prompt) - 1)]
    got = out.prompt_logprobs.logprobs[1:]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < TOL
    assert llm.engine.num_live_requests() == 0


def test_n_samples_share_the_prompt_and_are_seeded_per_index(llm):
    prompt = _prompt(random.Random(4), 75)
    hits = llm.engine.stats().prefix_cache_hit_tokens_total
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, n=4))[0]
    assert len(greedy.outputs) == 4
    assert all(o.token_ids == greedy.outputs[0].token_ids for o in greedy.outputs)
    # Samples 1..3 reused the first one's full prompt pages.
    assert llm.engine.stats().prefix_cache_hit_tokens_total - hits == 3 * (75 // 16) * 16
    seeded = SamplingParams(temperature=1.0, max_tokens=8, n=4, seed=100)
    one = llm.generate([prompt], seeded)[0]
    again = llm.generate([prompt], seeded)[0]
    assert [o.token_ids for o in one.outputs] == [o.token_ids for o in again.outputs]
    assert len({tuple(o.token_ids) for o in one.outputs}) > 1
    # Sample i is seeded with seed + i: the same as a single request with that seed.
    alone = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=8, seed=102))[0]
    assert alone.token_ids == one.outputs[2].token_ids
    assert llm.engine.num_live_requests() == 0


def _repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


def test_repetition_penalty_reduces_repeats(llm):
    rng = random.Random(5)
    prompts = [_prompt(rng, 8) for _ in range(4)]
    base = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = llm.generate(prompts, base)
    strong = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, repetition_penalty=5.0)
    penalised = llm.generate(prompts, strong)
    before = sum(_repeats(o.token_ids) for o in plain)
    after = sum(_repeats(o.token_ids) for o in penalised)
    assert before >= 5 and after < before / 2, (before, after)
    freq = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, frequency_penalty=2.0)
    assert sum(_repeats(o.token_ids) for o in llm.generate(prompts, freq)) < before
    banned = plain[0].token_ids[0]
    biased = SamplingParams(temperature=0, max_tokens=8, logit_bias={banned: -100})
    assert banned not in llm.generate([prompts[0]], biased)[0].token_ids


def test_plain_requests_unchanged_in_a_mixed_batch(llm):
    rng = random.Random(6)
    plain_prompts = [_prompt(rng, rng.randint(3, 60)) for _ in range(6)]
    plain = [SamplingParams(temperature=0, max_tokens=10)] * 3 + [
        SamplingParams(temperature=0.9, seed=i, max_tokens=10) for i in range(3)
    ]
    alone = llm.generate(plain_prompts, plain)
    extra_prompts = [_prompt(rng, rng.randint(3, 60)) for _ in range(4)]
    extra = [
        SamplingParams(temperature=0.7, max_tokens=10, repetition_penalty=1.5, logprobs=5),
        SamplingParams(temperature=0, max_tokens=10, presence_penalty=1.0, logit_bias={11: 5}),
        SamplingParams(temperature=1.0, max_tokens=10, n=3, prompt_logprobs=2),
        SamplingParams(max_tokens=0, prompt_logprobs=1),
    ]
    mixed = llm.generate(plain_prompts + extra_prompts, plain + extra)
    assert [o.token_ids for o in mixed[:6]] == [o.token_ids for o in alone]
    assert len(mixed[8].outputs) == 3 and mixed[9].token_ids == []
    assert llm.engine.num_live_requests() == 0


# ---- min_tokens ------------------------------------------------------------------------------
def _eos_first(llm: LLM, **kw) -> SamplingParams:
    """Parameters under which the model's every pick is EOS (+100 on its ids)."""
    return SamplingParams(logit_bias={t: 100.0 for t in llm.engine.eos_token_ids}, **kw)


def test_min_tokens_holds_back_eos_greedy_sampled_and_n(llm):
    prompt = [11, 22, 33, 44]
    eos = set(llm.engine.eos_token_ids)
    early = llm.generate([prompt], _eos_first(llm, temperature=0, max_tokens=10))[0]
    assert len(early.token_ids) == 1 and early.token_ids[0] in eos and early.finish_reason == "stop"
    # Greedy: the best tokens but EOS for 5 tokens (those of a run that bans EOS outright),
    # then EOS; counted as a token, never shown.
    banned = SamplingParams(temperature=0, max_tokens=5, logit_bias=dict.fromkeys(eos, -100.0))
    want = llm.generate([prompt], banned)[0].token_ids
    params = [
        _eos_first(llm, temperature=0, max_tokens=10, min_tokens=5, logprobs=2),
        _eos_first(llm, temperature=1.0, seed=4, max_tokens=10, min_tokens=3, n=3),
        _eos_first(llm, temperature=0, max_tokens=10, min_tokens=4, ignore_eos=True),
    ]
    greedy, sampled, ignoring = llm.generate([prompt] * 3, params)
    assert greedy.token_ids[:5] == want and greedy.token_ids[5] in eos
    assert len(greedy.token_ids) == 6 and greedy.finish_reason == "stop"
    assert greedy.text == llm.tokenizer.decode(want)
    # Log-probabilities are the raw model's (vLLM's default): the first token's equal those
    # of the plain request's first token.
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=2))[0]
    assert greedy.logprobs is not None and plain.logprobs is not None
    assert greedy.logprobs.top_ids[0] == plain.logprobs.top_ids[0]
    assert greedy.logprobs.logprobs[0] == pytest.approx(plain.logprobs.logprobs[0], abs=1e-5)
    for o in sampled.outputs:  # each sample holds back its own
        assert len(o.token_ids) == 4 and o.token_ids[3] in eos and o.finish_reason == "stop"
        assert not eos & set(o.token_ids[:3])
    # ignore_eos: EOS masked for 4 tokens (as vLLM), then drawn and not ending the output.
    assert not eos & set(ignoring.token_ids[:4]) and set(ignoring.token_ids[4:]) <= eos
    assert len(ignoring.token_ids) == 10 and ignoring.finish_reason == "length"


def test_min_tokens_holds_back_stop_token_ids_and_stop_strings(llm):
    prompt = [5, 6, 7, 8, 9]
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    first = base.token_ids[0]
    stopped = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first], ignore_eos=True)
    assert llm.generate([prompt], stopped)[0].token_ids == [first]
    held = dataclasses.replace(stopped, min_tokens=3)
    out = llm.generate([prompt], held)[0]
    assert len(out.token_ids) >= 3 and first not in out.token_ids[:3]
    # A stop string in the text of the first min_tokens tokens does not end the output.
    text = llm.tokenizer.decode(base.token_ids[:1])
    strings = SamplingParams(temperature=0, max_tokens=8, stop=[text], ignore_eos=True)
    assert llm.generate([prompt], strings)[0].text == ""
    out = llm.generate([prompt], dataclasses.replace(strings, min_tokens=4))[0]
    assert out.token_ids[:4] == base.token_ids[:4]
    assert out.text.startswith(llm.tokenizer.decode(base.token_ids[:4]))


def test_min_tokens_and_a_grammar_that_must_end(llm):
    tok = llm.tokenizer
    prompt = tok.encode("say yes")
    eos = set(llm.engine.eos_token_ids)
    # The grammar allows only EOS after 'yes': the grammar wins, the output ends before
    # min_tokens (and the request does not fail for want of a token).
    done = _eos_first(llm, temperature=0, max_tokens=12, min_tokens=10, grammar_kind="regex",
                      grammar="yes")  # fmt: skip
    # Where it allows more than EOS, min_tokens holds EOS back.
    more = _eos_first(llm, temperature=0, max_tokens=12, min_tokens=6, grammar_kind="regex",
                      grammar="a+")  # fmt: skip
    a, b = llm.generate([prompt, prompt], [done, more])
    assert a.text == "yes" and a.finish_reason == "stop" and a.token_ids[-1] in eos
    assert len(a.token_ids) < 10
    assert len(b.token_ids) == 7 and b.token_ids[-1] in eos and b.finish_reason == "stop"
    assert set(b.text) == {"a"}


def test_min_tokens_through_preemption_and_prefix_hits(model_dir, llm):
    """A preempted request recomputes its KV and keeps its tokens: it holds EOS back for exactly
    as many tokens as without preemption; a prefix-cache hit changes nothing either."""
    rng = random.Random(11)
    prompts = [_prompt(rng, 36) for _ in range(4)]  # 2 full pages of 16 each
    params = [
        _eos_first(llm, temperature=0, max_tokens=16, min_tokens=9),
        _eos_first(llm, temperature=0.9, seed=5, max_tokens=16, min_tokens=12),
    ] * 2
    want = [o.token_ids for o in llm.generate(prompts, params)]
    assert [len(w) for w in want] == [10, 13, 10, 13]
    hits = llm.engine.stats().prefix_cache_hit_tokens_total
    again = [o.token_ids for o in llm.generate(prompts, params)]  # prompts cached now
    assert again == want and llm.engine.stats().prefix_cache_hit_tokens_total > hits
    small = LLM(model_dir, dtype="float32", device="cpu", num_pages=44, page_size=4)
    assert [o.token_ids for o in small.generate(prompts, params)] == want
    assert small.engine.stats().num_preemptions_total > 0
