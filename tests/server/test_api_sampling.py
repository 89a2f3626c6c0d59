"""logprobs, echo + prompt logprobs, n and penalties over HTTP, checked against transformers.

One server of its own: a small prefill budget (--max-prefill-tokens 48), so a long prompt is
prefilled in chunks, and --max-n 8.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from harness import ServerProcess
from sse import stream_events

from minisgl.tokenizer.token_text import TokenTexts

TOL = 1e-4
MSG = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("sampling") / "server.log"
    # Kernels and prefill chunks fixed, not timed: these tests compare logprobs with
    # transformers' to 1e-4, and picks or chunk sizes timed on a busy machine sum the random
    # model's float32 in other orders (2.3e-4 off once in a loaded run).
    flags = ("--num-pages", "1024", "--max-prefill-tokens", "48", "--max-n", "8",
             "--cpu-kernel-tuning", "off", "--prefill-chunk-overhead", "0")  # fmt: skip
    s = ServerProcess(tiny_model_dir, log, *flags).wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oai(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)


@lru_cache(maxsize=1)
def _hf(model_dir: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_lsm(model_dir: Path, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = _hf(str(model_dir))(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def hf_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf_lsm(model_dir, ids)[-1].argmax()))
    return ids[len(prompt) :]


def chat_prompt_ids(hf_tokenizer: Any) -> list[int]:
    text = hf_tokenizer.apply_chat_template(MSG, tokenize=False, add_generation_prompt=True)
    return list(hf_tokenizer.encode(text, add_special_tokens=False))


def _idle(srv: ServerProcess) -> None:
    srv.wait_idle(within=10.0)
    s = srv.stats()["scheduler"]
    assert s.get("engine_live_requests") in (0, None) and s.get("detokenizer_live_requests") == 0


# ---- logprobs -------------------------------------------------------------------------------
def _check_chat_content(
    content: list[Any], lsm: torch.Tensor, start: int, ids: list[int], texts: TokenTexts, k: int
) -> None:
    assert len(content) == len(ids)
    for j, entry in enumerate(content):
        pos = start + j
        assert bytes(entry["bytes"]) == texts.get(ids[j])[1]
        assert entry["token"] == texts.get(ids[j])[0]
        assert abs(entry["logprob"] - float(lsm[pos, ids[j]])) < TOL
        values, top = lsm[pos].topk(k)
        assert len(entry["top_logprobs"]) == k
        for alt, v, tid in zip(entry["top_logprobs"], values.tolist(), top.tolist(), strict=True):
            assert abs(alt["logprob"] - v) < TOL
            assert bytes(alt["bytes"]) == texts.get(tid)[1]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_match_transformers(srv, oai, tiny_model_dir, hf_tokenizer, stream):
    prompt = chat_prompt_ids(hf_tokenizer)
    want = hf_greedy(tiny_model_dir, prompt, 6)
    lsm = hf_lsm(tiny_model_dir, prompt + want)
    texts = TokenTexts(hf_tokenizer)
    kw: dict[str, Any] = dict(
        model="m", messages=MSG, temperature=0, max_tokens=6, logprobs=True, top_logprobs=5
    )
    kw["extra_body"] = {"ignore_eos": True}
    if stream:
        content = []
        for chunk in oai.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                if c.logprobs is not None and c.logprobs.content:
                    content += [e.model_dump() for e in c.logprobs.content]
    else:
        r = oai.chat.completions.create(**kw)
        content = [e.model_dump() for e in r.choices[0].logprobs.content]
    _check_chat_content(content, lsm, len(prompt) - 1, want, texts, 5)
    _idle(srv)


def _check_echo(
    body: dict[str, Any], lsm: torch.Tensor, prompt: list[int], k: int, texts: TokenTexts
) -> None:
    lp = body["logprobs"]
    n = len(lp["tokens"])
    assert n >= len(prompt)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"][: len(prompt)] == [texts.get(t)[0] for t in prompt]
    for i in range(1, n):
        token_id = prompt[i] if i < len(prompt) else None
        values, _ = lsm[i - 1].topk(k)
        got_top = sorted(lp["top_logprobs"][i].values(), reverse=True)
        assert len(got_top) <= k  # equal token strings collapse in the dict
        assert all(abs(a - b) < TOL for a, b in zip(got_top, values.tolist()))
        if token_id is not None:
            assert abs(lp["token_logprobs"][i] - float(lsm[i - 1, token_id])) < TOL, i
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_echo_scores_every_prompt_token_despite_cache_and_chunks(
    srv, tiny_model_dir, hf_tokenizer, stream
):
    rng = random.Random(11 + stream)
    shared = [rng.randrange(0, 151643) for _ in range(40)]
    url = f"{srv.url}/v1/completions"
    # Cache the shared prefix first, then score prompts that start with it (a partial hit)
    # and one of 130 tokens (three prefill chunks of 48).
    httpx.post(url, json={"prompt": shared + [7], "max_tokens": 1}, timeout=60).raise_for_status()
    prompts = [shared + [rng.randrange(0, 151643) for _ in range(25)],
               [rng.randrange(0, 151643) for _ in range(130)]]  # fmt: skip
    texts = TokenTexts(hf_tokenizer)
    for prompt in prompts:
        body: dict[str, Any] = {"prompt": prompt, "echo": True, "logprobs": 3, "max_tokens": 2,
                                "temperature": 0, "ignore_eos": True}  # fmt: skip
        if stream:
            events = stream_events(url, {**body, "stream": True})
            parts = [c for e in events if isinstance(e, dict) for c in e["choices"]]
            lps = [c["logprobs"] for c in parts if c["logprobs"]]
            merged = {k: [v for p in lps for v in p[k]] for k in lps[0]}
            choice = {"text": "".join(c["text"] for c in parts), "logprobs": merged}
        else:
            r = httpx.post(url, json=body, timeout=60)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
        generated = hf_greedy(tiny_model_dir, prompt, 2)
        lsm = hf_lsm(tiny_model_dir, prompt + generated)
        _check_echo(choice, lsm, prompt, 3, texts)
        assert len(choice["logprobs"]["tokens"]) == len(prompt) + 2
        for j, tok in enumerate(generated):
            got = choice["logprobs"]["token_logprobs"][len(prompt) + j]
            assert abs(got - float(lsm[len(prompt) + j - 1, tok])) < TOL
        assert choice["text"].startswith(hf_tokenizer.decode(prompt))
    _idle(srv)


def test_loglikelihood_of_a_continuation_as_harnesses_ask(srv, oai, tiny_model_dir, hf_tokenizer):
    context, continuation = "The capital of France is", " Paris, of course."
    r = oai.completions.create(
        model="m", prompt=context + continuation, echo=True, logprobs=1, max_tokens=0
    )
    choice = r.choices[0]
    assert choice.text == context + continuation and r.usage.completion_tokens == 0
    ids = hf_tokenizer.encode(context + continuation, add_special_tokens=False)
    n_ctx = len(hf_tokenizer.encode(context, add_special_tokens=False))
    lsm = hf_lsm(tiny_model_dir, ids)
    want = sum(float(lsm[i - 1, ids[i]]) for i in range(n_ctx, len(ids)))
    got = sum(choice.logprobs.token_logprobs[n_ctx:])
    assert abs(got - want) < TOL * len(ids)
    # The text of an ids prompt is echoed too (decoded by the server).
    r2 = oai.completions.create(model="m", prompt=ids, echo=True, max_tokens=0)
    assert r2.choices[0].text == hf_tokenizer.decode(ids)
    _idle(srv)


# ---- n ----------------------------------------------------------------------------------------
def test_n_choices_with_the_openai_client(srv, oai):
    greedy = oai.chat.completions.create(model="m", messages=MSG, n=4, temperature=0, max_tokens=8)
    assert sorted(c.index for c in greedy.choices) == [0, 1, 2, 3]
    assert len({c.message.content for c in greedy.choices}) == 1
    kw: dict[str, Any] = dict(
        model="m", messages=MSG, n=4, temperature=1.0, seed=42, max_tokens=8,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    first = oai.chat.completions.create(**kw)
    again = oai.chat.completions.create(**kw)
    texts = [c.message.content for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.message.content for c in sorted(again.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1
    assert first.usage.completion_tokens == 4 * 8  # every sample counts; the prompt once
    assert first.usage.prompt_tokens == greedy.usage.prompt_tokens
    # Streaming: chunks carry their choice's index and reassemble to the same texts.
    streamed = ["", "", "", ""]
    reasons: dict[int, str] = {}
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert streamed == texts and sorted(reasons) == [0, 1, 2, 3]
    # Completions: index i is seeded with seed + i, like a single request with that seed.
    comp = oai.completions.create(
        model="m", prompt="Once upon", n=3, temperature=1.0, seed=7, max_tokens=6
    )
    single = oai.completions.create(
        model="m", prompt="Once upon", temperature=1.0, seed=9, max_tokens=6
    )
    assert sorted(comp.choices, key=lambda c: c.index)[2].text == single.choices[0].text
    _idle(srv)


def test_n_beyond_the_server_limit_is_a_400_naming_n(srv, oai):
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model="m", messages=MSG, n=9, max_tokens=2)
    assert exc.value.body["param"] == "n" and "--max-n" in exc.value.body["message"]


# ---- penalties ----------------------------------------------------------------------------------
def _tokens(oai: openai.OpenAI, **extra: Any) -> list[str]:
    r = oai.completions.create(
        model="m", prompt="the the the", max_tokens=48, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True, **extra},
    )  # fmt: skip
    return r.choices[0].logprobs.tokens


def test_repetition_penalty_reduces_repeated_tokens(srv, oai):
    plain = _tokens(oai)
    penalised = _tokens(oai, repetition_penalty=5.0)
    repeats = len(plain) - len(set(plain))
    assert repeats >= 5 and len(penalised) - len(set(penalised)) < repeats / 2
    freq = oai.completions.create(
        model="m", prompt="the the the", max_tokens=48, temperature=0, frequency_penalty=2.0,
        presence_penalty=1.0, logprobs=0, extra_body={"ignore_eos": True},
    ).choices[0].logprobs.tokens  # fmt: skip
    assert len(freq) - len(set(freq)) < repeats
    _idle(srv)


def test_logit_bias_bans_and_forces(srv, oai, hf_tokenizer):
    plain = oai.completions.create(model="m", prompt="Hello", max_tokens=4, temperature=0)
    first = hf_tokenizer.encode(plain.choices[0].text, add_special_tokens=False)[0]
    banned = oai.completions.create(
        model="m", prompt="Hello", max_tokens=4, temperature=0, logit_bias={str(first): -100}
    )
    assert not banned.choices[0].text.startswith(hf_tokenizer.decode([first]))
    forced = oai.chat.completions.create(
        model="m", messages=MSG, max_tokens=3, temperature=1.0, logit_bias={"9707": 100},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert forced.choices[0].message.content == hf_tokenizer.decode([9707] * 3)


# ---- mixing -----------------------------------------------------------------------------------
def test_plain_requests_unchanged_when_batched_with_every_feature(srv):
    url = f"{srv.url}/v1/completions"
    rng = random.Random(5)
    plain = [{"prompt": [rng.randrange(0, 151643) for _ in range(rng.randint(5, 60))],
              "max_tokens": 12, "temperature": 0, "ignore_eos": True} for _ in range(4)]  # fmt: skip
    plain.append({"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.8, "seed": 3})
    alone = [httpx.post(url, json=b, timeout=60).json()["choices"][0]["text"] for b in plain]
    extra = [
        {"prompt": "a b c", "max_tokens": 12, "repetition_penalty": 1.7, "logprobs": 5},
        {"prompt": "x y", "max_tokens": 12, "n": 3, "presence_penalty": 1.0, "temperature": 1.0},
        {"prompt": [5] * 90, "max_tokens": 0, "echo": True, "logprobs": 2},
        {"prompt": "z", "max_tokens": 12, "logit_bias": {"11": 50}, "frequency_penalty": 0.5},
    ]
    results: dict[int, Any] = {}

    def run(i: int, body: dict[str, Any]) -> None:
        results[i] = httpx.post(url, json=body, timeout=120).json()

    bodies = plain + extra
    threads = [threading.Thread(target=run, args=(i, b)) for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i]["choices"][0]["text"] for i in range(len(plain))] == alone
    assert len(results[len(plain) + 1]["choices"]) == 3
    assert max(srv.stats()["max_batch_size"], 0) > 1
    _idle(srv)
