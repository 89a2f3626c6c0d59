"""The engine sizes a burst's prefill chunks from its own step timings (served engines only):
once prefill and decode steps have been timed, the scheduler gets the budget they give, and a
burst's first requests get their first tokens before its last ones are prefilled; outputs are
the same as in one step; offline LLM batches keep one step."""

from __future__ import annotations

from minisgl.config import EngineArgs
from minisgl.engine.engine import Engine
from minisgl.llm import LLM
from minisgl.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def prompts(n: int, length: int = 40, seed: int = 0) -> list[list[int]]:
    return [[(7 * i + 3 * j + 11 * seed) % 200 + 5 for j in range(length)] for i in range(n)]


def run(engine: Engine, ps: list[list[int]]) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Each request's first-token step and its tokens."""
    for i, p in enumerate(ps):
        engine.add_request(f"b{i}", p, GREEDY)
    first: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    k = 0
    while engine.has_unfinished():
        for o in engine.step():
            first.setdefault(o.rid, k)
            tokens.setdefault(o.rid, []).extend(o.new_token_ids)
        k += 1
    return first, tokens


def test_a_served_engine_chunks_a_burst_once_it_has_timed_its_steps(tiny_model_dir) -> None:
    args = EngineArgs(model=str(tiny_model_dir), device="cpu", num_pages=256, page_size=4)
    engine = Engine(args)
    assert engine.scheduler.soft_prefill_tokens is None  # nothing timed yet: one step per burst
    run(engine, prompts(1, 8, seed=1))  # a prefill, then decodes: the step costs are known
    run(engine, prompts(1, 64, seed=2))
    budget = engine.prefill_budget
    assert budget is not None
    # The engine hands the scheduler what its timings give (whatever this machine measured).
    assert engine.scheduler.soft_prefill_tokens == budget.tokens()
    engine.scheduler.soft_prefill_tokens = 40  # one prompt a step
    engine.prefill_budget = None  # (keep it fixed for the check)
    first, chunked = run(engine, prompts(4))
    assert [first[f"b{i}"] for i in range(4)] == [0, 1, 2, 3]

    one_step = Engine(
        EngineArgs(
            model=str(tiny_model_dir),
            device="cpu",
            num_pages=256,
            page_size=4,
            prefill_chunk_overhead=0.0,
        )
    )
    assert one_step.prefill_budget is None
    first, whole = run(one_step, prompts(4))
    assert set(first.values()) == {0}
    assert whole == chunked  # greedy: the same tokens, chunked or not


def test_offline_llm_batches_are_not_chunked(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir), device="cpu", num_pages=64)
    try:
        assert llm.engine.prefill_budget is None
    finally:
        llm.shutdown()
