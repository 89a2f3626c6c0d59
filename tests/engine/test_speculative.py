"""Speculative decoding (ngram) in the engine: token for token what plain decoding gives, for
every architecture, batched, with prefix-cache hits, chunked prefill, preemption and TP=2; drafts
really accepted on a copying workload; stops, max_tokens, logprobs, penalties, seeds, n > 1
and grammars unchanged; every page back after the work."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from minisgl import LLM, SamplingParams
from minisgl.testing.copy_model import write_copy_model
from minisgl.testing.frozen_cost import freeze_step_costs

pytestmark = pytest.mark.timeout(300)

K = 4  # draft tokens per step
T0 = 1000  # the copying workload's first token


@pytest.fixture(scope="module")
def copy_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 as a bigram model (attention outputs zeroed): a sequence the model
    generated, fed back in the prompt, is what it generates again, so ngram drafts copied from
    it are accepted."""
    return write_copy_model(tiny_model_dir, tmp_path_factory.mktemp("copy") / "model")


def _llm(model_dir: Path | str, spec: bool, **kw) -> LLM:
    kw.setdefault("num_pages", 256)
    kw.setdefault("page_size", 4)
    kw.setdefault("cpu_kernel_tuning", "off")  # kernel choice never changes tokens
    if spec:
        kw.update(speculative_algorithm="ngram", speculative_num_draft_tokens=K)
    # Draft counts must not follow this machine's load: the step costs frozen, or with TP
    # (rank 0's engine a subprocess) no adaptivity at all.
    tp = kw.get("tp_size", 1) > 1
    if spec and tp:
        kw["disable_speculative_adaptive"] = True
    llm = LLM(str(model_dir), dtype="float32", **kw)
    if spec and not tp:
        freeze_step_costs(llm.engine)
    return llm


@pytest.fixture(scope="module")
def plain(copy_model_dir) -> LLM:
    return _llm(copy_model_dir, spec=False)


@pytest.fixture(scope="module")
def spec(copy_model_dir) -> LLM:
    return _llm(copy_model_dir, spec=True)


@pytest.fixture(scope="module")
def chain(plain) -> list[int]:
    """T0 and the model's greedy continuation of it."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    return [T0] + plain.generate([[T0]], params)[0].token_ids


def counting(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list:
    """Every StepOutput the engine returns from now on (for the draft counts)."""
    seen: list = []
    step = llm.engine.step

    def counted():
        outs = step()
        seen.extend(outs)
        return outs

    monkeypatch.setattr(llm.engine, "step", counted)
    return seen


def assert_no_pages_held(llm: LLM) -> None:
    st = llm.engine.stats()
    assert st.num_pages_used == 0
    assert st.num_pages_free + st.num_pages_cached == st.num_pages_total


def test_copying_workload_accepts_drafts_and_changes_nothing(plain, spec, chain, monkeypatch):
    """One batch: greedy copies, max_tokens, a stop token and a stop string landing inside
    accepted runs, logprobs, penalties, seeded sampling with n = 2 and a grammar."""
    tok = plain.tokenizer
    prompt = chain + [T0]  # continues as the chain did
    at = next(i for i in range(4, 20) if tok.decode([chain[i]]).strip().isalnum())
    stop_text = tok.decode([chain[at]]).strip()  # an output token's text, some way in
    cases = [
        (prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)),
        (chain[:12] + [chain[3]], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)),
        (prompt, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)),
        (prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[chain[6]])),
        (prompt, SamplingParams(temperature=0, max_tokens=20, stop=[stop_text], ignore_eos=True)),
        (prompt, SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)),
        (prompt, SamplingParams(temperature=0, max_tokens=8, frequency_penalty=0.4)),
        (prompt, SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3)),
        (prompt, SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=8, n=2)),
        (
            tok.encode("ab ab ab ab ab ab ab ab"),
            SamplingParams(temperature=0, max_tokens=12, grammar_kind="regex", grammar="(ab )+cd"),
        ),
    ]
    prompts = [c[0] for c in cases]
    params = [c[1] for c in cases]
    want = plain.generate(prompts, params)
    seen = counting(spec, monkeypatch)
    got = spec.generate(prompts, params)
    for w, g in zip(want, got, strict=True):
        assert [(o.token_ids, o.text, o.finish_reason) for o in g.outputs] == [
            (o.token_ids, o.text, o.finish_reason) for o in w.outputs
        ]
    assert got[0].token_ids == chain[1:21]
    assert len(got[2].token_ids) == 7 and got[2].finish_reason == "length"
    assert got[3].token_ids == chain[1:7] and got[3].finish_reason == "stop"
    assert got[4].finish_reason == "stop" and len(got[4].token_ids) == at
    assert stop_text not in got[4].text
    lp_w, lp_g = want[5].logprobs, got[5].logprobs
    assert lp_w is not None and lp_g is not None
    assert lp_g.token_ids == lp_w.token_ids and lp_g.top_ids == lp_w.top_ids
    assert lp_g.logprobs == pytest.approx(lp_w.logprobs, abs=1e-4)
    # Drafts were accepted, and the steps emitted runs of them.
    by_rid: dict[str, list] = {}
    for out in seen:
        assert out.spec_accepted_tokens <= out.spec_draft_tokens
        assert len(out.new_token_ids) <= out.spec_accepted_tokens + 1
        by_rid.setdefault(out.rid, []).append(out)
    copier = max(by_rid.values(), key=lambda outs: sum(len(o.new_token_ids) for o in outs))
    assert sum(o.spec_accepted_tokens for o in copier) >= 12 and len(copier) <= 8
    constrained = [o for o in seen if o.prompt_tokens == len(prompts[-1])]
    assert len(prompts[-1]) not in map(len, prompts[:-1])
    assert sum(o.spec_draft_tokens for o in constrained) > 0  # drafts the grammar allows
    assert_no_pages_held(spec)


def test_min_tokens_rejects_stop_drafts(copy_model_dir, plain, chain, monkeypatch):
    """Drafts that are EOS or a stop_token_id at a position min_tokens holds back are never
    kept: cut before scoring, and (with that cut off) rejected by the masked logits."""
    eos = plain.engine.eos_token_ids
    bias = {t: 100.0 for t in eos}  # the model's every pick is EOS
    # After the first output token (chain[1], EOS held back), the suffix [T0, chain[1]] recurs
    # at the start: the drafter proposes chain[2], EOS, ...
    cases = [
        ([T0, chain[1], chain[2], eos[0], T0], SamplingParams(
            temperature=0, max_tokens=12, min_tokens=6, logit_bias=bias)),
        (chain + [T0], SamplingParams(
            temperature=0, max_tokens=12, min_tokens=6, stop_token_ids=[chain[3]],
            ignore_eos=True)),
        (chain + [T0], SamplingParams(
            temperature=0.8, seed=2, max_tokens=12, min_tokens=5, logit_bias=bias, n=2)),
    ]  # fmt: skip
    prompts = [c[0] for c in cases]
    params = [c[1] for c in cases]
    want = plain.generate(prompts, params)
    assert want[0].token_ids[:6] == chain[1:7] and want[0].token_ids[6] in eos
    assert len(want[0].token_ids) == 7 and want[0].finish_reason == "stop"
    assert chain[3] not in want[1].token_ids[:6]
    # K drafts every step, however few are kept.
    spec = _llm(copy_model_dir, spec=True, disable_speculative_adaptive=True)
    proposed: list[list[int]] = []
    propose = spec.engine.drafter.propose

    def recording(reqs, ks):
        out = propose(reqs, ks)
        proposed.extend(list(d) for d in out)
        return out

    monkeypatch.setattr(spec.engine.drafter, "propose", recording)

    def outputs(results):
        return [[(o.token_ids, o.text, o.finish_reason) for o in r.outputs] for r in results]

    assert outputs(spec.generate(prompts, params)) == outputs(want)
    assert any(eos[0] in d for d in proposed) and any(chain[3] in d for d in proposed)
    # Scored anyway (no cut): the masked logits reject them.
    monkeypatch.setattr(spec.engine, "_drafts_before_stop", lambda req, drafts: drafts)
    seen = counting(spec, monkeypatch)
    assert outputs(spec.generate(prompts, params)) == outputs(want)
    assert sum(o.spec_draft_tokens for o in seen) > sum(o.spec_accepted_tokens for o in seen)
    assert_no_pages_held(spec)


def test_preemption_with_drafts_is_identical(copy_model_dir, plain, chain, monkeypatch):
    rng = random.Random(5)
    prompts = [chain[: rng.randint(8, 28)] for _ in range(4)]
    prompts = [p + [p[rng.randrange(len(p) - 1)]] for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    small = _llm(copy_model_dir, spec=True, num_pages=20, page_size=4)
    seen = counting(small, monkeypatch)
    assert [o.token_ids for o in small.generate(prompts, params)] == want
    assert sum(o.spec_accepted_tokens for o in seen) > 0
    assert small.engine.stats().num_preemptions_total > 0
    assert_no_pages_held(small)


ARCH_FIXTURES = ["tiny_model_dir", "moe_model_dir", "qwen2_model_dir", "llama_model_dir"]


@pytest.mark.parametrize("fixture", ARCH_FIXTURES)
def test_parity_prompts_batched_chunked_and_cached_match_transformers(fixture, request):
    from test_generate_vs_hf import check_identical, mixed_prompts

    model_dir = str(request.getfixturevalue(fixture))
    rng = random.Random(6)
    # A span that recurs: the drafter proposes what followed it (mostly rejected here).
    span = [rng.randrange(0, 151643) for _ in range(6)]
    echo = [span + [rng.randrange(0, 151643) for _ in range(9)] + span]
    prompts = mixed_prompts(4) + echo
    llm = _llm(model_dir, spec=True, num_pages=512, page_size=16, max_prefill_tokens=32)
    check_identical(model_dir, llm, prompts, max_tokens=6)
    first = llm.engine.stats().prefix_cache_hit_tokens_total
    check_identical(model_dir, llm, prompts[-2:], max_tokens=6)  # again: prefix-cache hits
    assert llm.engine.stats().prefix_cache_hit_tokens_total > first
    assert_no_pages_held(llm)


def test_tp2_verifies_rank_zeros_drafts(copy_model_dir, plain, chain, monkeypatch):
    prompts = [chain + [T0], [9, 8, 7, 6]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    with _llm(copy_model_dir, spec=True, num_pages=64, tp_size=2) as tp2:
        seen = counting(tp2, monkeypatch)
        assert [o.token_ids for o in tp2.generate(prompts, params)] == want
        assert sum(o.spec_accepted_tokens for o in seen) > 0
        assert_no_pages_held(tp2)
