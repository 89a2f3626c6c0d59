"""SamplingParams, as an offline user builds it: a wrong value is a ValueError naming the
field (never a raw TypeError, never accepted), and what the server accepts is accepted."""

from __future__ import annotations

import math

import pytest

from minisgl.sampling_params import SamplingParams

REFUSED = [
    ({"n": 2.5}, "n must be an integer"),
    ({"n": "2"}, "n must be an integer"),
    ({"n": True}, "n must be an integer"),
    ({"max_tokens": 16.5}, "max_tokens must be an integer"),
    ({"max_tokens": None}, "max_tokens must be an integer"),
    ({"top_k": 2**31}, "top_k must be"),
    ({"seed": -1}, "seed must be in"),
    ({"seed": 2**63}, "seed must be in"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"logprobs": 2.5}, "logprobs must be an integer"),
    ({"temperature": math.inf}, "temperature must be a finite number"),
    ({"temperature": math.nan}, "temperature must be a finite number"),
    ({"temperature": 101.0}, "temperature must be in"),
    ({"temperature": "0.5"}, "temperature must be a number"),
    ({"top_p": math.nan}, "top_p must be a finite number"),
    ({"min_p": -math.inf}, "min_p must be a finite number"),
    ({"presence_penalty": math.inf}, "presence_penalty must be a finite number"),
    ({"repetition_penalty": 1000.0}, "repetition_penalty must be in"),
    ({"stop": [1]}, "stop must be a string or a list of strings"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids must be an integer"),
    ({"stop_token_ids": [-3]}, "stop_token_ids must be >= 0"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {5: math.nan}}, "logit_bias must be a finite number"),
    ({"ignore_eos": "yes"}, "ignore_eos must be true or false"),
]


@pytest.mark.parametrize(("kwargs", "message"), REFUSED, ids=[str(k) for k, _ in REFUSED])
def test_bad_values_are_value_errors_naming_the_field(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_what_the_server_accepts_is_accepted() -> None:
    # JSON's 2.0 is the integer 2 for the server's request model: the same here.
    p = SamplingParams(n=2.0, max_tokens=8.0, top_k=40.0, seed=7.0)  # type: ignore[arg-type]
    assert (p.n, p.max_tokens, p.top_k, p.seed) == (2, 8, 40, 7)
    assert all(type(v) is int for v in (p.n, p.max_tokens, p.top_k, p.seed))
    edge = SamplingParams(
        temperature=100,
        top_p=1,
        min_p=1,
        top_k=2**31 - 1,
        seed=2**63 - 1,
        repetition_penalty=100.0,
        presence_penalty=-2,
        frequency_penalty=2,
        logit_bias={"42": -100, 7: 100},
        stop="\n",
        stop_token_ids=[0],
    )
    assert edge.temperature == 100.0 and isinstance(edge.temperature, float)
    assert edge.logit_bias == {42: -100.0, 7: 100.0}
    assert edge.stop == ["\n"]
    # The n samples' own parameters (seed + i) stay valid at the largest seed.
    assert edge.sample_params(1).seed == 0
