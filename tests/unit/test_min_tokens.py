"""min_tokens (vLLM) / min_new_tokens (SGLang): the masking of stop tokens, the stop strings the
detokenizer skips, and the request fields. The served and engine paths: tests/server/
test_api_min_tokens.py, tests/engine/test_sampling_features.py, tests/engine/test_speculative.py.
"""

from __future__ import annotations

import pytest
import torch

from minisgl.layers.penalties import ban_tokens, min_tokens_bans, only_allows
from minisgl.layers.sampling import SamplingBatch, sample
from minisgl.sampling_params import SamplingParams
from minisgl.server.protocol import ChatCompletionRequest, CompletionRequest
from minisgl.speculative.verify import verify
from minisgl.tokenizer.incremental import IncrementalDecoder

EOS = 7


# ---- which rows ban which tokens ----------------------------------------------------------
def test_bans_cover_exactly_the_positions_before_min_tokens() -> None:
    # Request 0: 2 generated of min 4, scored at 3 rows (2 drafts): rows 0, 1 draw tokens 2, 3.
    # Request 1: no min_tokens. Request 2: 5 generated of min 5: nothing left to hold back.
    # Request 3: 0 generated of min 1, one row.
    bans = min_tokens_bans(
        steps=[2, 0, 5, 0],
        widths=[3, 1, 2, 1],
        min_tokens=[4, 0, 5, 1],
        stop_ids=[[EOS, 9], [], [EOS], [EOS]],
    )
    assert bans == ([0, 0, 1, 1, 6], [EOS, 9, EOS, 9, EOS])
    assert min_tokens_bans([3], [1], [3], [[EOS]]) is None  # reached: nothing to mask


def test_a_grammar_that_can_only_end_wins() -> None:
    forced: list[int] = []

    def forced_end(row: int, ids: object) -> bool:
        forced.append(row)
        return row == 1

    bans = min_tokens_bans([0], [3], [10], [[EOS]], forced_end)
    assert bans == ([0, 2], [EOS, EOS]) and forced == [0, 1, 2]


def test_only_allows_reads_the_bitmask_words() -> None:
    vocab = 70
    mask = torch.zeros(2, (vocab + 31) // 32, dtype=torch.int32)
    # Row 0: only tokens 31 (the sign bit of word 0) and 64 allowed.
    mask[0, 0] = torch.tensor(1 << 31, dtype=torch.int64).to(torch.int32)
    mask[0, 2] = 1
    assert only_allows(mask[0], [31, 64])
    assert not only_allows(mask[0], [31])
    assert not only_allows(mask[0], [64, 5])
    mask[1, 1] = 1 << 3  # token 35
    assert not only_allows(mask[1], [31, 64])
    assert only_allows(mask[1], [35])


# ---- the mask at the sampler ----------------------------------------------------------------
def _logits(rows: int, vocab: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, vocab, generator=g)
    x[:, EOS] = 50.0  # every row would draw EOS
    return x


def test_greedy_and_sampled_rows_never_draw_a_banned_token() -> None:
    logits = _logits(4)
    raw = logits.clone()
    ban_tokens(logits, ([0, 0, 2, 3], [EOS, 3, EOS, EOS]))
    assert torch.isneginf(logits[0, EOS]) and torch.isneginf(logits[0, 3])
    assert logits[1, EOS] == 50.0  # row 1 not banned: untouched
    others = torch.ones_like(logits, dtype=torch.bool)
    others[[0, 0, 2, 3], [EOS, 3, EOS, EOS]] = False
    assert torch.equal(logits[others], raw[others])
    greedy = SamplingParams(temperature=0)
    hot = SamplingParams(temperature=5.0)
    params = [greedy, greedy, hot, hot]
    for seed in range(50):
        batch = SamplingBatch.build(params, [0, 0, seed, seed], [seed] * 4, "cpu")
        got = sample(logits, batch).tolist()
        assert got[0] == int(logits[0].argmax()) and got[0] not in (EOS, 3)
        assert got[1] == EOS
        assert got[2] != EOS and got[3] != EOS


def test_a_drafted_eos_before_min_tokens_is_rejected() -> None:
    # One request with 2 drafts [EOS, 4]: scored at 3 rows; the target wants EOS everywhere.
    logits = _logits(3)
    drafts = [[EOS, 4]]
    params = [SamplingParams(temperature=0)]
    _, runs = verify(logits.clone(), drafts, params, [0], [0])
    assert runs[0][0] == EOS  # unmasked: the drafted EOS is accepted (the target's own token)
    bans = min_tokens_bans([0], [3], [2], [[EOS]])  # rows 0 and 1 draw tokens 0 and 1
    assert bans == ([0, 1], [EOS, EOS])
    masked = logits.clone()
    ban_tokens(masked, bans)
    _, runs = verify(masked, drafts, params, [0], [0])
    assert runs == [[int(masked[0].argmax())]] and runs[0][0] != EOS


# ---- request fields -----------------------------------------------------------------------
def test_sampling_params_bounds() -> None:
    assert SamplingParams(max_tokens=5, min_tokens=5).min_tokens == 5
    with pytest.raises(ValueError, match="min_tokens=6 and max_tokens=5"):
        SamplingParams(max_tokens=5, min_tokens=6)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=-1)
    # Each of n samples holds back its own stop tokens.
    assert SamplingParams(n=3, min_tokens=4).sample_params(2).min_tokens == 4


def test_protocol_takes_either_name() -> None:
    msg = [{"role": "user", "content": "hi"}]
    assert ChatCompletionRequest(messages=msg, min_tokens=3).least_tokens() == 3  # type: ignore[arg-type]
    assert ChatCompletionRequest(messages=msg, min_new_tokens=4).least_tokens() == 4  # type: ignore[arg-type]
    assert CompletionRequest(prompt="x").least_tokens() == 0
    same = CompletionRequest(prompt="x", min_tokens=2, min_new_tokens=2)
    assert same.unsupported() is None and same.least_tokens() == 2
    bad = CompletionRequest(prompt="x", min_tokens=2, min_new_tokens=3).unsupported()
    assert bad is not None and bad[0] == "min_new_tokens" and "min_tokens (2)" in bad[1]
    assert CompletionRequest(prompt="x", min_tokens=5).unsupported() is None


# ---- stop strings in the detokenizer ------------------------------------------------------
class CharTokenizer:
    """Token i is the character chr(i) (EOS: no text)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i != EOS)


def _run(text: str, min_tokens: int, stop: list[str], **kw: object) -> tuple[str, str, int]:
    dec = IncrementalDecoder(CharTokenizer(), stop=stop, min_tokens=min_tokens, **kw)  # type: ignore[arg-type]
    shown = ""
    for i, ch in enumerate(text):
        last = i == len(text) - 1
        shown += dec.feed([ord(ch)], finished=last, finish_reason="length" if last else None)
        if dec.stopped:
            break
    return shown, dec.text, dec.num_tokens


def test_stop_strings_wait_for_min_tokens_as_vllm() -> None:
    # vLLM's own case (tests/detokenizer/test_min_tokens.py), one character per token here.
    text = " is Lee, and I'm a student"
    assert _run(text, 0, ["e"])[1] == " is L"
    # The first 5 tokens ' is L' are not searched; the next 'e' is token 6: cut before it.
    shown, final, used = _run(text, 5, ["e"])
    assert final == shown == " is L" and used == 6
    # With 10, the first 'e' after token 10 (' is Lee, a') is in 'student'.
    shown, final, used = _run(text, 10, ["e"])
    assert final == shown == " is Lee, and I'm a stud" and used == len(" is Lee, and I'm a stude")


def test_a_stop_string_may_begin_inside_min_tokens() -> None:
    # 'abc' spans tokens 3..5; min_tokens 4: it ends in token 5, past min_tokens: a hit, as in
    # vLLM (the search starts len(stop) - 1 characters before the new text).
    shown, final, used = _run("xyabcdef", 4, ["abc"])
    assert final == shown == "xy" and used == 5
    # One ending at token 4 exactly (within min_tokens) is not; the next one is.
    shown, final, used = _run("xabcdabcz", 4, ["abc"])
    assert final == shown == "xabcd" and used == 8
    # A short stop string lying before the boundary is never matched later either.
    assert _run("e12345", 1, ["e", "longstop"])[1] == "e12345"


def test_streamed_text_never_shows_what_a_stop_string_cuts() -> None:
    # Within min_tokens the tail that could begin a stop string is held back too.
    dec = IncrementalDecoder(CharTokenizer(), stop=["ab"], min_tokens=3)
    parts = [dec.feed([ord(c)], finished=False, finish_reason=None) for c in "xya"]
    assert "".join(parts) == "xy"  # 'a' held: it may begin 'ab'
    assert dec.feed([ord("b")], finished=False, finish_reason=None) == ""
    assert dec.stopped and dec.text == "xy"


def test_min_tokens_equal_to_the_whole_output_shows_it_all() -> None:
    # Finished at min_tokens (max_tokens == min_tokens): nothing held back, nothing searched.
    shown, final, used = _run("xxab", 4, ["ab"])
    assert shown == final == "xxab" and used == 4
