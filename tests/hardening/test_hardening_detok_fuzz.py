"""Hypothesis fuzz of incremental detokenization with the real Qwen3 tokenizer.

Random token sequences mix single-byte tokens (so UTF-8 characters are split anywhere, or
never completed), CJK and emoji pieces, special tokens and arbitrary vocabulary ids; they are
fed in random chunk sizes. Properties: the streamed chunks add up to the full decode (so no
chunk ever shows a U+FFFD that the full text lacks), and with stop strings the stream is the
full text cut where the first stop string to complete starts: no stop string, or any part of
one that the final text cuts, ever leaks.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisgl.tokenizer.incremental import IncrementalDecoder

FUZZ = settings(
    max_examples=int(os.environ.get("HARDENING_FUZZ_EXAMPLES", "250")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
SAMPLES = "中文测试 naïve café 🙂👍🏽🇯🇵 ℃ Ωmega ẞ 𝔘𝔫𝔦 \n\t end. <think> x</think> 😀"


@pytest.fixture(scope="module")
def pieces(hf_tokenizer: Any) -> dict[str, list[int]]:
    tok = hf_tokenizer
    return {
        # Byte-level BPE: ids 0..255 are the single bytes, lead and continuation bytes alike.
        "bytes": list(range(256)),
        "text": sorted(set(tok.encode(SAMPLES, add_special_tokens=False))),
        "special": sorted(set(tok.all_special_ids) | set(tok.added_tokens_decoder)),
        "eos": [tok.eos_token_id],
        "vocab": [len(tok) - 1],
    }


def _ids(pieces: dict[str, list[int]]) -> st.SearchStrategy[list[int]]:
    one = st.one_of(
        st.sampled_from(pieces["bytes"]),
        st.sampled_from(pieces["text"]),
        st.sampled_from(pieces["special"]),
        st.integers(0, pieces["vocab"][0]),
    )
    return st.lists(one, min_size=1, max_size=40)


def _stream(dec: IncrementalDecoder, ids: list[int], cuts: list[int], reason: str) -> list[str]:
    """Feed ids in the chunks `cuts` draws; the last feed is the finishing one."""
    chunks: list[str] = []
    pos = 0
    sizes = [max(1, c) for c in cuts] or [1]
    i = 0
    while pos < len(ids):
        n = sizes[i % len(sizes)]
        i += 1
        part = ids[pos : pos + n]
        pos += n
        done = pos >= len(ids)
        chunks.append(dec.feed(part, finished=done, finish_reason=reason if done else None))
        if dec.stopped:
            break
    return chunks


@FUZZ
@given(data=st.data(), skip=st.booleans(), reason=st.sampled_from(["length", "stop"]))
def test_chunks_add_up_to_the_full_decode(
    hf_tokenizer: Any, pieces: dict[str, list[int]], data: st.DataObject, skip: bool, reason: str
) -> None:
    ids = data.draw(_ids(pieces), label="ids")
    eos_last = reason == "stop" and data.draw(st.booleans(), label="eos_last")
    if eos_last:
        ids = [*ids, pieces["eos"][0]]
    cuts = data.draw(st.lists(st.integers(1, 5), max_size=6), label="cuts")
    dec = IncrementalDecoder(hf_tokenizer, hidden_token_ids=pieces["eos"], skip_special_tokens=skip)
    chunks = _stream(dec, ids, cuts, reason)
    # A hidden EOS that ends the request ends the text, it is not part of it.
    shown = ids[:-1] if reason == "stop" and ids[-1] in pieces["eos"] else ids
    full = hf_tokenizer.decode(shown, skip_special_tokens=skip)
    assert "".join(chunks) == full
    assert dec.num_tokens == len(ids)
    at = 0
    for c in chunks:  # each chunk is exactly the next piece of the full text
        assert full[at : at + len(c)] == c
        at += len(c)


@FUZZ
@given(data=st.data(), skip=st.booleans())
def test_stop_strings_cut_the_text_and_never_leak(
    hf_tokenizer: Any, pieces: dict[str, list[int]], data: st.DataObject, skip: bool
) -> None:
    ids = data.draw(_ids(pieces), label="ids")
    full = hf_tokenizer.decode(ids, skip_special_tokens=skip)
    stops: list[str] = []
    if full:  # stop strings taken from the text itself, so they really hit
        for _ in range(data.draw(st.integers(1, 3), label="nstops")):
            a = data.draw(st.integers(0, len(full) - 1), label="a")
            b = data.draw(st.integers(a + 1, min(len(full), a + 6)), label="b")
            stops.append(full[a:b])
    stops += data.draw(st.lists(st.text(min_size=1, max_size=4), max_size=2), label="extra")
    cuts = data.draw(st.lists(st.integers(1, 4), max_size=6), label="cuts")
    dec = IncrementalDecoder(hf_tokenizer, stop=stops, skip_special_tokens=skip)
    chunks = _stream(dec, ids, cuts, "length")
    streamed = "".join(chunks)
    assert dec.text == streamed  # the decoder's final text is what the client saw
    assert full.startswith(streamed)
    for s in stops:
        assert s not in streamed  # no stop string leaks, whole
    found = [(full.find(s), s) for s in stops if s in full]
    if not found:
        assert streamed == full and not dec.stopped
        return
    # Generation stops at the first stop string to COMPLETE (as in OpenAI/vLLM): the text is
    # cut where a stop string starts, no later than the start of the one that ends first.
    assert dec.stopped
    assert any(full.startswith(s, len(streamed)) for s in stops), (streamed, stops)
    first_end = min(p + len(s) for p, s in found)
    assert len(streamed) <= min(p for p, s in found if p + len(s) == first_end)
