"""EAGLE-3 through the engine: the head's drafts verified by the target, greedy output
unchanged, and the drafter fed the right rows of the target's hidden states."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from minisgl.config import EngineArgs
from minisgl.engine.model_runner import ForwardInput
from minisgl.sampling_params import SamplingParams
from minisgl.scheduler.request import Request
from minisgl.speculative.eagle3_drafter import Eagle3Drafter
from minisgl.testing.eagle3_writer import write_eagle3_head
from minisgl.testing.frozen_cost import freeze_step_costs


@pytest.fixture(scope="module")
def head_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_eagle3_head(
        tmp_path_factory.mktemp("eagle3-head"),
        tiny_model_dir,
        draft_vocab_size=2048,
        aux_layer_ids=(0, 1, 1),  # the tiny target has two layers
    )


def _run(engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], int, int]:
    """Greedy outputs of `prompts` (one batch) and the drafts verified / accepted."""
    for i, p in enumerate(prompts):
        engine.add_request(f"q{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens))
    out: dict[str, list[int]] = {f"q{i}": [] for i in range(len(prompts))}
    drafted = accepted = 0
    while engine.has_unfinished():
        for o in engine.step():
            out[o.rid] += o.new_token_ids
            drafted += o.spec_draft_tokens
            accepted += o.spec_accepted_tokens
            assert o.spec_accepted_tokens <= o.spec_draft_tokens
    return [out[f"q{i}"] for i in range(len(prompts))], drafted, accepted


def test_greedy_output_is_unchanged_by_eagle3_drafts(head_dir: Path, tiny_model_dir: Path) -> None:
    """Batched, chunked prefill, then a second batch that hits the prefix cache: the same
    tokens as without speculation, with the head's drafts verified along the way; and the
    drafts the live drafter made are those a fresh drafter makes from the target's own
    hidden states of the whole sequence (the engine hands over the right rows)."""
    from minisgl.engine.engine import Engine

    base = dict(
        model=str(tiny_model_dir),
        device="cpu",
        dtype="float32",
        num_pages=128,
        page_size=4,
        max_prefill_tokens=16,  # prompts of 20+ tokens prefill in chunks
        cpu_kernel_tuning="off",
    )
    rng = random.Random(3)
    shared = [rng.randrange(151_000) for _ in range(12)]
    first = [[rng.randrange(151_000) for _ in range(n)] for n in (23, 5)] + [shared + [7, 8]]
    second = [shared + [rng.randrange(151_000) for _ in range(n)] for n in (6, 14)]
    plain = Engine(EngineArgs(**base))
    want = [_run(plain, first, 8)[0], _run(plain, second, 8)[0]]

    spec = Engine(
        EngineArgs(
            **base,
            speculative_algorithm="eagle3",
            speculative_draft_model_path=str(head_dir),
            speculative_num_draft_tokens=3,
        )
    )
    freeze_step_costs(spec)  # draft counts must not follow this machine's load
    drafter = spec.drafter
    assert isinstance(drafter, Eagle3Drafter)
    seen: list[tuple[list[int], list[int]]] = []  # (tokens so far, drafts) of request q0
    propose = drafter.propose

    def recording(reqs, num_tokens):
        drafts = propose(reqs, num_tokens)
        for r, d in zip(reqs, drafts, strict=True):
            if r.rid == "q0" and d and not seen:
                seen.append((r.all_ids, list(d)))
        return drafts

    drafter.propose = recording  # type: ignore[method-assign]
    got1, drafted1, _ = _run(spec, first, 8)
    drafter.propose = propose  # type: ignore[method-assign]
    got2, drafted2, accepted = _run(spec, second, 8)
    assert [got1, got2] == want
    assert drafted1 > 0 and drafted2 > 0 and accepted >= 0
    assert spec.scheduler.prefix_cache_hit_tokens_total > 0
    assert drafter._ctx == {}  # every finished request released

    tokens, drafts = seen[0]
    runner = spec.runner
    captured = runner.forward(
        ForwardInput(
            token_ids=tokens[:-1],
            prefix_lens=[0],
            extend_lens=[len(tokens) - 1],
            page_tables=[list(range(-(-len(tokens) // 4)))],
            sample_rows=[],
            sample_params=[],
            sample_steps=[],
            sample_seeds=[],
            capture_layers=drafter.capture_layers,
        )
    )
    fresh = Eagle3Drafter(drafter.head, drafter.capture_layers)
    req = Request("q0", tokens[: len(first[0])], SamplingParams(temperature=0))
    req.output_ids = tokens[len(first[0]) :]
    req.num_computed = len(tokens) - 1
    fresh.accepted([req], [0], captured.hidden, [range(len(tokens) - 1)])
    assert fresh.propose([req], [len(drafts)]) == [drafts]


def _eagle3_llm(model_dir: Path, head: Path, **kw):
    from minisgl import LLM

    kw.setdefault("page_size", 4)
    tp = kw.get("tp_size", 1) > 1
    if tp:  # rank 0's engine is a subprocess: no frozen costs there, so no adaptivity
        kw["disable_speculative_adaptive"] = True
    llm = LLM(
        str(model_dir),
        dtype="float32",
        cpu_kernel_tuning="off",  # kernel choice never changes tokens
        speculative_algorithm="eagle3",
        speculative_draft_model_path=str(head),
        speculative_num_draft_tokens=4,
        **kw,
    )
    if not tp:
        freeze_step_costs(llm.engine)  # draft counts must not follow this machine's load
    return llm


def _count_drafts(llm, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """[drafts verified so far]: every step the engine runs from now on adds its count."""
    total = [0]
    step = llm.engine.step

    def counted():
        outs = step()
        total[0] += sum(o.spec_draft_tokens for o in outs)
        return outs

    monkeypatch.setattr(llm.engine, "step", counted)
    return total


@pytest.mark.parametrize("fixture", ["moe_model_dir", "qwen2_model_dir", "llama_model_dir"])
def test_other_architectures_match_transformers_with_eagle3(
    fixture: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen3-MoE, Qwen2 and Llama (untied, llama3 RoPE) targets: transformers' greedy tokens,
    batched with chunked prefill, then again from the prefix cache, with a random head's
    drafts verified throughout."""
    from test_generate_vs_hf import hf_greedy, mixed_prompts

    model_dir = request.getfixturevalue(fixture)
    head = write_eagle3_head(tmp_path, model_dir, draft_vocab_size=512, aux_layer_ids=(0, 1, 1))
    llm = _eagle3_llm(model_dir, head, num_pages=256, max_prefill_tokens=32)
    drafts = _count_drafts(llm, monkeypatch)
    prompts = mixed_prompts(5)[2:]  # 7, 16 and 17 tokens: one step cannot prefill them all
    want = [hf_greedy(str(model_dir), p, 8)[0] for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=8)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    hits = llm.engine.stats().prefix_cache_hit_tokens_total
    assert [o.token_ids for o in llm.generate(prompts[::-1], params)][::-1] == want
    assert llm.engine.stats().prefix_cache_hit_tokens_total > hits
    assert drafts[0] > 0


def test_tp2_with_preemption_verifies_the_heads_drafts(
    head_dir: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks and too few pages for the batch: rank 0 captures the hidden states and
    drafts, both ranks verify its drafts, requests are preempted (their head state dropped)
    and recomputed, and the tokens are those of plain decoding on one rank with room for all."""
    from minisgl import LLM

    rng = random.Random(5)
    prompts = [[rng.randrange(151_000) for _ in range(rng.randint(8, 20))] for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    plain = LLM(
        str(tiny_model_dir), dtype="float32", num_pages=128, page_size=4, cpu_kernel_tuning="off"
    )
    want = [o.token_ids for o in plain.generate(prompts, params)]
    with _eagle3_llm(tiny_model_dir, head_dir, num_pages=20, tp_size=2) as tp2:
        drafts = _count_drafts(tp2, monkeypatch)
        assert [o.token_ids for o in tp2.generate(prompts, params)] == want
        assert tp2.engine.stats().num_preemptions_total > 0 and drafts[0] > 0
