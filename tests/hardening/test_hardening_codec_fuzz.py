"""Hypothesis fuzz of the msgpack codec: every message round-trips; garbage is a CodecError."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisgl.message.api_to_tokenizer import AbortRequest, Ping, TokenizeRequest
from minisgl.message.codec import CodecError, decode, encode
from minisgl.message.detokenizer_to_api import ErrorReply, RequestAccepted, TextBatch, TextOutput
from minisgl.message.scheduler_to_detokenizer import (
    RequestEnded,
    RequestRegistered,
    SchedulerStatsUpdate,
    TokenBatch,
    TokenOutput,
)
from minisgl.message.tokenizer_to_scheduler import TokenizedRequest
from minisgl.sampling_params import INT_MAX, SamplingParams

FUZZ = settings(
    max_examples=int(os.environ.get("HARDENING_FUZZ_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

i64 = st.integers(-(2**63), 2**63 - 1)
u32 = st.integers(0, 2**32 - 1)
text = st.text(max_size=40)  # any code point, surrogates excluded: what JSON can carry
floats = st.floats(allow_nan=False)  # NaN != NaN would fail equality, not the codec
rid = st.text(min_size=1, max_size=30)
opt_float = st.none() | floats
json_leaf = st.none() | st.booleans() | i64 | floats | text
json_value = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12,
)
# Within what SamplingParams accepts (its own validation rejects larger values at build).
params = st.builds(
    SamplingParams,
    temperature=st.floats(0, 100),
    top_p=st.floats(0.01, 1),
    top_k=st.integers(-1, INT_MAX),
    min_p=st.floats(0, 1),
    seed=st.none() | st.integers(0, 2**63 - 1),
    max_tokens=st.integers(1, INT_MAX),
    ignore_eos=st.booleans(),
    stop=st.lists(st.text(min_size=1, max_size=8), max_size=4),
    stop_token_ids=st.lists(u32, max_size=4),
)
token_out = st.builds(
    TokenOutput, rid, st.lists(u32, max_size=4), st.booleans(), st.none() | text,
    u32, u32, u32, opt_float,
)  # fmt: skip
text_out = st.builds(
    TextOutput, rid, text, st.booleans(), st.none() | text, u32, u32, u32, opt_float
)
MESSAGES = st.one_of(
    st.builds(
        TokenizeRequest,
        rid=rid,
        arrival_time=floats,
        params=params,
        max_tokens=st.none() | st.integers(1, 2**31),
        messages=st.none() | st.lists(st.dictionaries(text, text, max_size=3), max_size=3),
        chat_template_kwargs=st.dictionaries(text, json_value, max_size=3),
        prompt_text=st.none() | text,
        prompt_ids=st.none() | st.lists(u32, max_size=8),
        skip_special_tokens=st.booleans(),
    ),
    st.builds(AbortRequest, rid),
    st.builds(Ping, i64, st.lists(text, max_size=4)),
    st.builds(
        TokenizedRequest,
        rid,
        st.lists(u32, max_size=8),
        params,
        st.none() | st.integers(1, 2**31),
        floats,
        st.booleans(),
    ),  # fmt: skip
    st.builds(
        RequestRegistered,
        rid,
        st.lists(text, max_size=3),
        st.lists(u32, max_size=3),
        st.booleans(),
        u32,
    ),  # fmt: skip
    token_out,
    st.builds(TokenBatch, st.lists(token_out, max_size=5)),
    st.builds(RequestEnded, rid, text, text, st.integers(100, 599), st.none() | text),
    st.builds(
        SchedulerStatsUpdate,
        st.dictionaries(text, json_value, max_size=5),
        st.lists(u32, max_size=5),
        floats,
    ),  # fmt: skip
    text_out,
    st.builds(TextBatch, st.lists(text_out, max_size=5)),
    st.builds(ErrorReply, rid, text, st.integers(100, 599), st.none() | text),
    st.builds(RequestAccepted, rid),
)


@FUZZ
@given(MESSAGES)
def test_every_message_round_trips(msg: Any) -> None:
    back = decode(encode(msg))
    assert type(back) is type(msg)
    assert back == msg


def _decodes_cleanly(data: bytes) -> None:
    """Garbage either decodes to plain data or raises CodecError (a ValueError), nothing else."""
    with contextlib.suppress(CodecError):
        decode(data)


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_never_raise_anything_but_codec_error(data: bytes) -> None:
    _decodes_cleanly(data)


@FUZZ
@given(MESSAGES, st.data())
def test_truncated_or_corrupted_messages_raise_codec_error(msg: Any, data: st.DataObject) -> None:
    raw = bytearray(encode(msg))
    cut = data.draw(st.integers(0, len(raw) - 1), label="cut")
    _decodes_cleanly(bytes(raw[:cut]))
    pos = data.draw(st.integers(0, len(raw) - 1), label="pos")
    raw[pos] = data.draw(st.integers(0, 255), label="byte")
    _decodes_cleanly(bytes(raw))


@FUZZ
@given(st.sampled_from(["abort", "ping", "tokenize", "text_out", "nope", ""]), json_value,
       st.integers(0, 127))  # fmt: skip
def test_forged_extension_objects_raise_codec_error(tag: str, fields: Any, code: int) -> None:
    """A well-formed msgpack extension with the wrong code, tag or fields never builds an
    object and never leaks a TypeError/KeyError out of decode()."""
    payload = msgpack.packb([tag, fields], use_bin_type=True)
    forged = msgpack.packb(msgpack.ExtType(code, payload), use_bin_type=True)
    try:
        decode(forged)
    except CodecError:
        return
    # Only a registered class with exactly matching fields may come out.
    assert code == 1 and isinstance(fields, dict)


def test_unregistered_objects_are_refused_on_encode() -> None:
    class Secret:
        pass

    for bad in (Secret(), {1, 2}, object()):
        try:
            encode(bad)
        except TypeError:
            continue
        raise AssertionError(f"{bad!r} was encoded")
