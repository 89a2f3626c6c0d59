"""The offline API and the engine when things go wrong: interrupted calls, logits without a
distribution, refused requests, and which text a stop token leaves."""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.engine.engine import SAMPLING_FAILED, StepOutput
from minisgl.engine.worker import SchedulerLoop
from minisgl.message.scheduler_to_detokenizer import RequestEnded, TokenBatch

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), dtype="float32", device="cpu", num_pages=256)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 151643) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _assert_idle(llm: LLM) -> None:
    assert not llm.engine.has_unfinished()
    assert llm.engine.num_live_requests() == 0
    assert llm.engine.stats().num_pages_used == 0


def test_a_tiny_temperature_is_greedy(llm: LLM) -> None:
    prompts = _prompts(3, seed=1)
    greedy = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    for t in (1e-40, 1e-7):
        tiny = SamplingParams(temperature=t, max_tokens=8, ignore_eos=True)
        assert [o.token_ids for o in llm.generate(prompts, tiny)] == greedy


def test_an_interrupted_generate_leaves_nothing_behind(llm: LLM, monkeypatch) -> None:
    prompts = _prompts(4, seed=2)
    expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    real_step, calls = llm.engine.step, 0

    def interrupted() -> list[StepOutput]:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the call
        return real_step()

    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, GREEDY)
    monkeypatch.undo()
    _assert_idle(llm)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    _assert_idle(llm)


def test_nan_logits_end_the_request_with_an_error(llm: LLM, monkeypatch) -> None:
    real_model = llm.engine.runner.model

    def poisoned(*args: Any) -> torch.Tensor:
        logits = real_model(*args)
        logits[0] = float("nan")
        return logits

    monkeypatch.setattr(llm.engine.runner, "model", poisoned)
    for params in (GREEDY, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8)):
        with pytest.raises(RuntimeError, match="NaN or infinite logits"):
            llm.generate(_prompts(1, seed=3), params)
        _assert_idle(llm)
    monkeypatch.undo()
    assert len(llm.generate(_prompts(1, seed=3), GREEDY)[0].token_ids) == 8


def test_a_refused_request_leaves_no_arrival_entry(llm: LLM) -> None:
    engine = llm.engine
    ids = _prompts(1, seed=4)[0]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("twice", ids, params)
    (first,) = engine.step()  # scheduled: its arrival time became its queue time
    assert first.queue_time is not None
    with pytest.raises(ValueError, match="already scheduled"):
        engine.add_request("twice", ids, params)
    later = []
    while engine.has_unfinished():
        later += engine.step()
    # The refused copy left no arrival behind: no second queue time (a metrics sample) for
    # the request that runs, and nothing left over once it is done.
    assert len(later) == 3 and all(o.queue_time is None for o in later)
    _assert_idle(llm)


def test_stop_token_text_is_cut_unless_asked_for(llm: LLM) -> None:
    tok = llm.tokenizer
    prompt = _prompts(1, seed=8)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10))[0]
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    assert tok.decode([stop_at], skip_special_tokens=True)  # a token with text
    for include in (False, True):
        params = SamplingParams(
            temperature=0,
            max_tokens=10,
            stop_token_ids=[stop_at],
            include_stop_str_in_output=include,
        )
        out = llm.generate([prompt], params)[0]
        assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1]
        shown = free.token_ids[: first + 1] if include else free.token_ids[:first]
        assert out.text == tok.decode(shown, skip_special_tokens=True)
    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    for include in (False, True):
        params = SamplingParams(
            temperature=0, max_tokens=10, stop=[stop], include_stop_str_in_output=include
        )
        out = llm.generate([prompt], params)[0]
        cut = text.index(stop) + (len(stop) if include else 0)
        assert (out.text, out.finish_reason) == (text[:cut], "stop")
    _assert_idle(llm)


class _Sink:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def put(self, msg: Any) -> None:
        self.sent.append(msg)


class _FailingEngine:
    """Two requests in one step: one fine, one whose logits had no distribution."""

    def step(self) -> list[StepOutput]:
        ok = StepOutput("ok", [5], False, None, 3, 0, 1)
        bad = StepOutput("bad", [], True, "error", 3, 0, 0, error=SAMPLING_FAILED)
        return [ok, bad]

    def stats(self) -> Any:
        return type("S", (), {"last_batch_size": 2})()


def test_the_scheduler_worker_reports_a_failed_request_as_an_error() -> None:
    sink = _Sink()
    loop = SchedulerLoop(_FailingEngine(), None, sink, logging.getLogger("t"))  # type: ignore[arg-type]
    loop.step()
    batches = [m for m in sink.sent if isinstance(m, TokenBatch)]
    ended = [m for m in sink.sent if isinstance(m, RequestEnded)]
    assert [o.rid for b in batches for o in b.outputs] == ["ok"]
    assert [(e.rid, e.reason, e.status) for e in ended] == [("bad", "error", 500)]
    assert "NaN or infinite logits" in ended[0].message


def test_calls_from_threads_each_get_their_own_outputs(llm: LLM) -> None:
    """Threads sharing one LLM: each call's outputs are its own, as if called alone (before,
    a call that stepped the engine met another thread's outputs: KeyError 'offline-4-0')."""
    import threading

    prompts = _prompts(4, seed=9)
    expected = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    got: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(prompts))

    def work(i: int) -> None:
        try:
            start.wait()
            got[i] = [llm.generate([prompts[i]], GREEDY)[0].token_ids for _ in range(3)]
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert got == {i: [expected[i]] * 3 for i in range(len(prompts))}
    _assert_idle(llm)


def test_prompts_that_are_no_prompts_are_refused_clearly(llm: LLM) -> None:
    """One prompt of ids passed flat ([1, 2, 3] for [[1, 2, 3]]) said "'int' object is not
    iterable", and a float id was truncated (1.5 ran as token 1)."""
    with pytest.raises(TypeError, match=r"one prompt of ids is \[\[1, 2, 3\]\]"):
        llm.generate([1, 2, 3], GREEDY)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="token ids are integers"):
        llm.generate([[1.5, 2]], GREEDY)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="token ids are integers"):
        llm.generate([[True, 2]], GREEDY)
    # Any sequence of integers is a prompt: a tuple, a numpy array, a tensor.
    import numpy as np

    want = llm.generate([[5, 6, 7]], GREEDY)[0].token_ids
    for ids in ((5, 6, 7), np.array([5, 6, 7]), torch.tensor([5, 6, 7])):
        assert llm.generate([ids], GREEDY)[0].token_ids == want  # type: ignore[list-item]
    _assert_idle(llm)


def test_a_closed_llm_says_so(tiny_model_dir) -> None:
    with LLM(str(tiny_model_dir), dtype="float32", num_pages=16, cpu_kernel_tuning="off") as one:
        assert len(one.generate([[1, 2, 3]], GREEDY)[0].token_ids) == 8
    with pytest.raises(RuntimeError, match="this LLM was shut down"):
        one.generate([[1, 2, 3]], GREEDY)
    one.shutdown()  # again: nothing to do
