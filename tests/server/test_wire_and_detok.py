"""In-process checks of the pieces under the service: codec, queues, incremental detokenizer."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import pytest
import zmq

from minisgl.message.api_to_tokenizer import AbortRequest, Ping, TokenizeRequest
from minisgl.message.codec import CodecError, decode, encode
from minisgl.message.endpoints import Endpoints
from minisgl.message.queue import AsyncPullQueue, PullQueue, PushQueue
from minisgl.message.scheduler_to_detokenizer import (
    RequestEnded,
    RequestRegistered,
    TokenBatch,
    TokenOutput,
)
from minisgl.sampling_params import SamplingParams
from minisgl.tokenizer.detokenizer_worker import Detokenizer
from minisgl.tokenizer.incremental import IncrementalDecoder


def test_codec_round_trips_nested_messages_without_pickle() -> None:
    req = TokenizeRequest(
        "r1",
        1.5,
        SamplingParams(temperature=0.0, stop=["x"], seed=7),
        None,
        messages=[{"role": "user", "content": "你好"}],
        chat_template_kwargs={"enable_thinking": False},
    )
    data = encode(req)
    assert b"pickle" not in data and decode(data) == req
    batch = TokenBatch([TokenOutput("a", [1, 2], True, "stop", 3, 0, 2, 0.01)])
    assert decode(encode(batch)) == batch


def test_user_data_cannot_forge_a_message() -> None:
    # chat_template_kwargs is a free-form user dict: it must stay a dict on the other side.
    forged = {"__t": "abort", "rid": "victim"}
    req = TokenizeRequest("r", 0.0, SamplingParams(), 4, chat_template_kwargs=forged)
    assert decode(encode(req)).chat_template_kwargs == forged
    with pytest.raises(CodecError):
        decode(msgpack.packb(msgpack.ExtType(1, msgpack.packb(["no_such_tag", {}]))))
    with pytest.raises(TypeError):
        encode(object())


def test_typed_queues_over_a_private_ipc_dir() -> None:
    a, b = Endpoints.create(), Endpoints.create()
    assert a.root != b.root  # two launches never share sockets
    ctx = zmq.Context()
    try:
        pull: PullQueue[Any] = PullQueue(ctx, a.scheduler, (AbortRequest, Ping))
        push: PushQueue[Any] = PushQueue(ctx, a.scheduler, (AbortRequest, Ping))
        push.put(AbortRequest("x"))
        push.put(Ping(3, ["tokenizer"]))
        got = pull.get_all(timeout=2.0)
        while len(got) < 2:
            got += pull.get_all(timeout=2.0)
        assert got == [AbortRequest("x"), Ping(3, ["tokenizer"])]
        with pytest.raises(TypeError):
            push.put(TokenBatch([]))  # not a message this channel carries
        assert pull.get(timeout=0.05) is None
        push.close()
        pull.close()
    finally:
        ctx.term()
        a.remove()
        b.remove()


def test_the_api_servers_queue_hands_every_message_on_in_order_past_bad_ones() -> None:
    """The API server's end of the pipeline, read by its event loop: what was queued before
    it started, a burst, and everything after a message that does not decode, is of a kind
    the channel does not carry or that its handler fails on."""
    ep = Endpoints.create()
    ctx = zmq.Context()
    got: list[Any] = []
    errors: list[Exception] = []

    def on_message(msg: Any) -> None:
        if msg == Ping(13, []):
            raise RuntimeError("handler failed")
        got.append(msg)

    async def main() -> None:
        pull: AsyncPullQueue[Any] = AsyncPullQueue(ctx, ep.api, (AbortRequest, Ping))
        push: PushQueue[Any] = PushQueue(ctx, ep.api, (AbortRequest, Ping))
        raw = ctx.socket(zmq.PUSH)
        raw.connect(ep.api)
        push.put(AbortRequest("early"))
        await asyncio.sleep(0.05)  # queued in ZMQ before the loop watches the socket
        pull.start(on_message, errors.append)
        for i in range(500):
            push.put(Ping(i, []))
        raw.send(b"\xc1 not msgpack")
        raw.send(encode(TokenBatch([])))  # a valid message, not one for this channel
        push.put(AbortRequest("after"))
        deadline = asyncio.get_running_loop().time() + 10
        while len(got) < 501 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        pull.close()
        push.put(AbortRequest("closed"))
        await asyncio.sleep(0.05)
        raw.close(linger=0)
        push.close()

    try:
        asyncio.run(main())
    finally:
        ctx.term()
        ep.remove()
    want = [AbortRequest("early")] + [Ping(i, []) for i in range(500) if i != 13]
    assert got == want + [AbortRequest("after")]
    # (the raw socket's two and the pushed ones are fair-queued: no order between them)
    assert sorted(type(e).__name__ for e in errors) == ["CodecError", "RuntimeError", "TypeError"]


def _stream(tok: Any, ids: list[int], **kw: Any) -> tuple[list[str], IncrementalDecoder]:
    dec = IncrementalDecoder(tok, **kw)
    chunks = [
        dec.feed([t], finished=i == len(ids) - 1, finish_reason="length") for i, t in enumerate(ids)
    ]
    return chunks, dec


def test_incremental_decoding_never_splits_a_character(hf_tokenizer: Any) -> None:
    text = "你好，世界！龘🦩 naïve café 🫠𓀀 🧑‍🚀"
    ids = hf_tokenizer.encode(text)
    # Byte-level BPE really does split these across tokens (else the test proves nothing).
    assert any("\ufffd" in hf_tokenizer.decode([t]) for t in ids)
    chunks, _ = _stream(hf_tokenizer, ids)
    assert "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)


def test_stop_strings_are_cut_and_never_leak_partially(hf_tokenizer: Any) -> None:
    text = "alpha beta gamma delta"
    ids = hf_tokenizer.encode(text)
    chunks, dec = _stream(hf_tokenizer, ids, stop=["gamma d", "zzz"])
    assert "".join(chunks) == "alpha beta "
    assert dec.stopped
    # Nothing of the stop string ever showed up, not even its first letter.
    assert all("g" not in c for c in chunks)
    # A prefix of a stop string that never completes is released at the end.
    chunks, dec = _stream(hf_tokenizer, hf_tokenizer.encode("one two"), stop=["two three"])
    assert "".join(chunks) == "one two" and not dec.stopped


def test_eos_is_counted_but_not_shown(hf_tokenizer: Any) -> None:
    eos = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = hf_tokenizer.encode("hello")
    dec = IncrementalDecoder(hf_tokenizer, hidden_token_ids=[eos], skip_special_tokens=False)
    out = dec.feed(ids, finished=False, finish_reason=None)
    out += dec.feed([eos], finished=True, finish_reason="stop")
    assert out == "hello" and dec.num_tokens == len(ids) + 1


def test_exactly_one_final_reply_per_request(hf_tokenizer: Any) -> None:
    detok = Detokenizer(hf_tokenizer)
    ids = hf_tokenizer.encode("one two three four")
    detok.handle(RequestRegistered("r", ["three"], [], True, 5))
    finals = []
    aborts = []
    for i, t in enumerate(ids):
        replies, ab = detok.handle(TokenBatch([TokenOutput("r", [t], False, None, 5, 0, i + 1)]))
        aborts += ab
        finals += [o for m in replies for o in m.outputs if o.finished]
    assert [f.finish_reason for f in finals] == ["stop"]
    assert aborts == [AbortRequest("r")]  # the scheduler is told to stop generating
    # Late outputs and the scheduler's abort confirmation produce nothing more.
    assert detok.handle(TokenBatch([TokenOutput("r", [1], True, "length", 5, 0, 9)])) == ([], [])
    assert detok.handle(RequestEnded("r", "abort")) == ([], [])


def test_samples_end_one_by_one_with_token_text_logprobs(hf_tokenizer: Any) -> None:
    from minisgl.logprobs import TokenLogprobs

    detok = Detokenizer(hf_tokenizer)
    ids = hf_tokenizer.encode("one two three")
    detok.handle(RequestRegistered("r", ["two"], [], True, 5, n=2, echo_ids=[ids[0]]))
    lp = TokenLogprobs([ids[0]], [-0.5], [[ids[0], ids[1]]], [[-0.5, -1.5]])
    replies, aborts = detok.handle(
        TokenBatch([TokenOutput("r", [ids[0]], False, None, 5, 0, 1, 0.1, 0, lp, lp)])
    )
    first = replies[0].outputs[0]
    assert first.index == 0 and first.prompt_text == "one" and first.prompt_logprobs is not None
    assert first.logprobs is not None and first.logprobs.tokens == ["one"]
    assert (
        first.logprobs.top_tokens == [["one", " two"]] and first.logprobs.top_bytes[0][1] == b" two"
    )
    # Sample 1 hits the stop string: only it ends, and only it is aborted in the scheduler.
    replies, aborts = detok.handle(
        TokenBatch([TokenOutput("r", ids[:2], False, None, 5, 0, 2, index=1)])
    )
    assert [(o.index, o.finished, o.finish_reason) for o in replies[0].outputs] == [
        (1, True, "stop")
    ]
    assert aborts == [AbortRequest("r", 1)]
    assert detok.handle(RequestEnded("r", "abort", index=1)) == ([], [])
    # A whole-request abort ends the sample still going, and nothing else.
    replies, _ = detok.handle(RequestEnded("r", "abort"))
    assert [(o.index, o.finish_reason) for o in replies[0].outputs] == [(0, "abort")]
    assert detok.decoders == {}
