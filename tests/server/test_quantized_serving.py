"""A model quantized at load served as users combine it: --quantization int4 with 8-bit
activations (--cpu-quantized-activations int8, given by its old name --cpu-int4-activations),
two tensor-parallel ranks, ngram speculative
decoding and prefill chunks of at most 32 tokens (so long prompts are chunked and the chunks
take the 8-bit path too). The start-up log and /metrics state the format; greedy tokens stay
those of the exact path but for near ties; a burst of n > 1, logprobs, structured output and
dropped streams gets one final reply each and leaves no KV page held; the server stops with
every process it started."""

from __future__ import annotations

import concurrent.futures as cf
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from harness import ServerProcess, pid_alive
from prometheus_client.parser import text_string_to_metric_families

from minisgl import LLM, SamplingParams
from minisgl.layers import cpu_kernels
from minisgl.tokenizer.token_text import TokenTexts

pytestmark = pytest.mark.timeout(300)
# Logprob gap under which the 8-bit activations may pick the other of the top two (see
# tests/engine/test_quantized_at_load.py's X8_TIE).
X8_TIE = 1.0
MAX_TOKENS = 12
PROMPTS = [
    [11, 4021, 883, 17, 9, 12001, 64, 3],
    [40, 41, 42, 43] * 6,  # repeats: the ngram drafter finds matches
    [(i * 7919) % 150000 + 5 for i in range(150)],  # chunked: 150 tokens in chunks of 32
]


@pytest.fixture(scope="module")
def quant_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from minisgl.testing.fixture import write_fixture_model

    # Hidden 128 and MLP 256: whole groups of 128 on both ranks.
    return write_fixture_model(tmp_path_factory.mktemp("quant"), "quant")


@pytest.fixture(scope="module")
def server(quant_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    log = tmp_path_factory.mktemp("qserver") / "server.log"
    srv = ServerProcess(
        quant_model_dir, log,
        "--quantization", "int4", "--cpu-int4-activations", "int8", "--tp-size", "2",
        "--speculative-algorithm", "ngram", "--max-prefill-tokens", "32",
        "--num-pages", "256", "--cpu-kernel-tuning", "off", "--log-level", "info",
    )  # fmt: skip
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def _reference(
    path: Path, **flags: Any
) -> tuple[list[list[int]], list[list[float]], list[list[float]]]:
    """Each prompt alone through int4 on one rank in this process, prefilled in the server's
    chunks: per prompt its greedy tokens' logprobs and top-two gaps, then its tokens."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    tokens: list[list[int]] = []
    lps: list[list[float]] = []
    gaps: list[list[float]] = []
    try:
        with LLM(
            str(path),
            dtype="float32",
            num_pages=64,
            cpu_kernel_tuning="off",
            quantization="int4",
            max_prefill_tokens=32,
            **flags,
        ) as llm:
            for i, ids in enumerate(PROMPTS):
                llm.engine.add_request(f"ref-{i}", ids, params)
                for out in (tokens, lps, gaps):
                    out.append([])
                while llm.engine.has_unfinished():
                    for step in llm.engine.step():
                        assert step.error is None, step.error
                        tokens[-1] += step.new_token_ids
                        lps[-1] += [top[0] for top in step.logprobs.top_logprobs]
                        gaps[-1] += [top[0] - top[1] for top in step.logprobs.top_logprobs]
    finally:
        cpu_kernels.set_quantized_activations("int16")
    return tokens, lps, gaps


def test_start_up_log_and_metrics_state_the_format(server: ServerProcess) -> None:
    logs = server.logs()
    assert "weights: int4 4-bit, group 128" in logs
    if cpu_kernels.int8_activation_rows():
        assert "x rounded to 8 bits" in logs and "--cpu-quantized-activations int8" in logs
    else:  # an AVX-512 build without VNNI: no 8-bit activation path
        assert "--cpu-quantized-activations int8 unused: these CPU kernels" in logs
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    labels = samples["minisgl_model_info"].labels
    assert (labels["quantization"], labels["lm_head"]) == ("int4", "int8")
    assert labels["activations"] == ("int8" if cpu_kernels.int8_activation_rows() else "exact")


def test_greedy_tokens_stay_the_exact_paths_but_near_ties(
    server: ServerProcess, quant_model_dir: Path, hf_tokenizer: Any
) -> None:
    """The served tokens are the exact path's up to a near tie; each prompt's first token
    (its prefill, which speculation leaves alone) has the logprob of one rank with 8-bit
    activations, not the exact path's: both ranks round x."""
    reference, exact_lps, gaps = _reference(quant_model_dir)
    _, x8_lps, _ = _reference(quant_model_dir, cpu_quantized_activations="int8")
    texts = TokenTexts(hf_tokenizer)
    moved = 0.0
    with httpx.Client(base_url=server.url, timeout=120) as c:
        for i, (ids, want, gap) in enumerate(zip(PROMPTS, reference, gaps, strict=True)):
            body = {"model": "m", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0}
            r = c.post("/v1/completions", json={**body, "ignore_eos": True, "logprobs": 1})
            assert r.status_code == 200, r.text
            logprobs = r.json()["choices"][0]["logprobs"]
            got = logprobs["tokens"]
            assert len(got) == MAX_TOKENS
            want_text = [texts.get(t)[0] for t in want]
            j = next((j for j, (a, b) in enumerate(zip(want_text, got)) if a != b), None)
            assert j is None or gap[j] <= X8_TIE, (j, want_text, got, gap)
            first = logprobs["token_logprobs"][0]
            assert abs(first - x8_lps[i][0]) < 0.01, (i, first, x8_lps[i][0], exact_lps[i][0])
            moved = max(moved, abs(x8_lps[i][0] - exact_lps[i][0]))
    if cpu_kernels.int8_activation_rows():
        assert moved > 0.01  # the two paths differ here, so the check above bites


def _burst(url: str) -> list[str]:
    """Requests a user mixes, all at once; what each one ended with."""

    def completion_n3() -> str:
        body = {"model": "m", "prompt": PROMPTS[2], "max_tokens": 10, "n": 3, "logprobs": 2}
        r = httpx.post(f"{url}/v1/completions", json={**body, "temperature": 0.8}, timeout=120)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert sorted(ch["index"] for ch in choices) == [0, 1, 2]
        assert all(len(ch["logprobs"]["tokens"]) == 10 for ch in choices)
        return "n3"

    def structured() -> str:
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "a number"}],
            "max_tokens": 60,
            "temperature": 0,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": schema},
            },
        }
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["message"]["content"])["a"], int)
        return "json"

    def dropped_stream() -> str:
        body = {"model": "m", "prompt": PROMPTS[1], "max_tokens": 400, "stream": True}
        with httpx.stream(
            "POST", f"{url}/v1/completions", json={**body, "ignore_eos": True}, timeout=120
        ) as s:
            for k, _ in enumerate(s.iter_lines()):
                if k >= 3:
                    break  # the client goes away mid-stream
        return "dropped"

    def greedy() -> str:
        body = {"model": "m", "prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return "greedy"

    jobs = [completion_n3, structured, dropped_stream, greedy] * 2
    with cf.ThreadPoolExecutor(len(jobs)) as ex:
        return list(ex.map(lambda f: f(), jobs))


def _finished(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "minisgl_requests_total"
    )


def test_a_mixed_burst_gets_one_reply_each_and_frees_its_pages(server: ServerProcess) -> None:
    before = _finished(server.url)
    assert sorted(_burst(server.url)) == sorted(["n3", "json", "dropped", "greedy"] * 2)
    idle = server.wait_idle()
    assert idle["num_pages_used"] == 0
    assert _finished(server.url) - before == 8  # each request finished once (n > 1: once)


def test_the_server_stops_with_every_process_it_started(server: ServerProcess) -> None:
    # Runs last: the module's server is stopped here (its teardown then finds it gone).
    children = psutil.Process(server.proc.pid).children(recursive=True)
    names = {c.pid: " ".join(c.cmdline()[-2:]) for c in children}
    assert len(children) >= 4  # tokenizer, detokenizer, scheduler (rank 0) and rank 1
    assert server.stop() == 0
    # A helper may still be on its way out when the server's own exit is seen (e.g.
    # multiprocessing's resource tracker leaves once every pipe to it has closed): a leak is a
    # process still there seconds later. Checked at once, one child was still alive in a CI
    # run (the whole suite on 2 busy cores).
    deadline = time.monotonic() + 10
    while [c for c in children if pid_alive(c.pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert {c.pid: names[c.pid] for c in children if pid_alive(c.pid)} == {}
