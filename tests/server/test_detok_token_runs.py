"""Speculative decoding hands the detokenizer runs of several tokens per step: a stop string
inside a run ends the output at the token that completed it, as one token per step would (the
usage counts and log-probabilities stop there too)."""

from __future__ import annotations

from typing import Any

from minisgl.logprobs import TokenLogprobs
from minisgl.message.scheduler_to_detokenizer import RequestRegistered, TokenBatch, TokenOutput
from minisgl.tokenizer.detokenizer_worker import Detokenizer
from minisgl.tokenizer.incremental import IncrementalDecoder


def test_a_run_past_a_stop_string_counts_only_the_tokens_up_to_it(hf_tokenizer: Any) -> None:
    ids = hf_tokenizer.encode(" one two three four five")
    upto = next(i for i in range(len(ids)) if "three" in hf_tokenizer.decode(ids[: i + 1])) + 1
    one_by_one = IncrementalDecoder(hf_tokenizer, stop=["three"])
    text = "".join(one_by_one.feed([t], finished=False, finish_reason=None) for t in ids[:upto])
    at_once = IncrementalDecoder(hf_tokenizer, stop=["three"])
    assert at_once.feed(ids, finished=False, finish_reason=None) == text == " one two "
    assert at_once.stopped and at_once.num_tokens == one_by_one.num_tokens == upto

    detok = Detokenizer(hf_tokenizer)
    detok.handle(RequestRegistered("r", ["three"], [], True, 5))
    lp = TokenLogprobs(ids, [-0.1] * len(ids), [[t] for t in ids], [[-0.1]] * len(ids))
    replies, aborts = detok.handle(
        TokenBatch([TokenOutput("r", ids, False, None, 5, 0, len(ids), None, 0, lp)])
    )
    out = replies[0].outputs[0]
    assert (out.text, out.finished, out.finish_reason) == (" one two ", True, "stop")
    assert out.completion_tokens == upto < len(ids)
    assert out.logprobs is not None and len(out.logprobs.tokens) == upto
    assert len(aborts) == 1
