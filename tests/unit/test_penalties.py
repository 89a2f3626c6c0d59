"""Penalties and logit_bias against a plain-Python reference on fixed logits."""

from __future__ import annotations

import random

import pytest
import torch

from minisgl.layers.penalties import PenaltyBatch, PenaltyState, apply_penalties
from minisgl.sampling_params import SamplingParams

VOCAB = 50


def reference(
    logits: list[float], params: SamplingParams, prompt: list[int], output: list[int]
) -> list[float]:
    """The documented semantics, one token at a time (HF, vLLM and OpenAI's formulas)."""
    out = list(logits)
    for tok, bias in params.logit_bias.items():
        out[tok] += bias
    seen = set(prompt) | set(output)
    r = params.repetition_penalty
    for tok in seen:
        out[tok] = out[tok] / r if out[tok] > 0 else out[tok] * r
    for tok in set(output):
        count = output.count(tok)
        out[tok] -= params.frequency_penalty * count + params.presence_penalty
    return out


def _case(rng: random.Random) -> tuple[SamplingParams, list[int], list[int]]:
    params = SamplingParams(
        presence_penalty=rng.choice([0.0, 0.5, -1.0, 2.0]),
        frequency_penalty=rng.choice([0.0, 0.3, -0.7, 1.5]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.8, 3.0]),
        logit_bias={rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randint(0, 4))},
    )
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
    output = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 30))]
    return params, prompt, output


def _states(cases: list, steps: int = 3) -> list[PenaltyState]:
    """States grown the way the runner grows them: a few outputs at a time."""
    states = []
    for params, prompt, output in cases:
        st = PenaltyState.create(params, prompt)
        for cut in range(0, len(output) + 1, max(1, len(output) // steps)):
            st.catch_up(output[:cut])
        st.catch_up(output)
        states.append(st)
    return states


def test_batch_matches_the_reference_row_by_row() -> None:
    rng = random.Random(0)
    torch.manual_seed(0)
    cases = [_case(rng) for _ in range(12)]
    logits = torch.randn(12, VOCAB) * 3
    want = [reference(logits[i].tolist(), *cases[i]) for i in range(12)]
    got = logits.clone()
    batch = PenaltyBatch.build(list(range(12)), [c[0] for c in cases], _states(cases), "cpu")
    apply_penalties(got, batch)
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-6, atol=1e-5)


def test_only_the_penalised_rows_change() -> None:
    rng = random.Random(1)
    cases = [_case(rng) for _ in range(2)]
    logits = torch.randn(5, VOCAB)
    got = logits.clone()
    batch = PenaltyBatch.build([1, 3], [c[0] for c in cases], _states(cases), "cpu")
    apply_penalties(got, batch)
    for row in (0, 2, 4):
        assert torch.equal(got[row], logits[row])
    for j, row in enumerate((1, 3)):
        torch.testing.assert_close(
            got[row], torch.tensor(reference(logits[row].tolist(), *cases[j]))
        )


def test_minus_100_bias_bans_a_token_and_plus_100_forces_it() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 7] = 10.0
    params = [SamplingParams(logit_bias={7: -100}), SamplingParams(logit_bias={3: 100})]
    states = [PenaltyState.create(p, [1]) for p in params]
    apply_penalties(logits, PenaltyBatch.build([0, 1], params, states, "cpu"))
    assert logits[0].argmax() != 7 and logits[1].argmax() == 3


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("logit_bias", {1: 101.0}),
        ("logit_bias", {-1: 1.0}),
        ("logprobs", 21),
        ("n", 0),
    ],
)
def test_out_of_range_values_are_rejected(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field.split("_")[0]):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_many_distinct_tokens_grow_the_state() -> None:
    vocab = 1000
    rng = random.Random(3)
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.2)
    prompt = rng.sample(range(vocab), 300)
    output = [rng.randrange(vocab) for _ in range(400)]
    state = PenaltyState.create(params, prompt)
    for cut in range(0, 401, 37):
        state.catch_up(output[:cut])
    state.catch_up(output)
    logits = torch.randn(1, vocab) * 4
    want = reference(logits[0].tolist(), params, prompt, output)
    apply_penalties(logits, PenaltyBatch.build([0], [params], [state], "cpu"))
    torch.testing.assert_close(logits[0], torch.tensor(want), rtol=1e-6, atol=1e-5)
