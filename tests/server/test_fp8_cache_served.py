"""`python -m minisgl --kv-cache-dtype fp8`: the server says what its KV cache holds (start-up
log, /metrics' model info) and serves the offline engine's greedy tokens over the same cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import ServerProcess
from prometheus_client.parser import text_string_to_metric_families

from minisgl import LLM, SamplingParams

PROMPTS = [[9707, 1879, 11, 1246, 525, 498], [785, 6722, 315, 9625, 374] * 8]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    log = tmp_path_factory.mktemp("fp8server") / "server.log"
    flags = ("--kv-cache-dtype", "fp8", "--num-pages", "128", "--cpu-kernel-tuning", "off")
    srv = ServerProcess(tiny_model_dir, log, *flags, "--log-level", "info")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_the_server_names_its_cache_and_serves_its_tokens(
    server: ServerProcess, tiny_model_dir: Path
) -> None:
    assert "dtype fp8_e4m3" in server.logs()  # the start-up log's KV cache line
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["minisgl_model_info"].labels["kv_cache"] == "fp8_e4m3"
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(str(tiny_model_dir), dtype="float32", num_pages=128, kv_cache_dtype="fp8") as llm:
        want = [o.text for o in llm.generate(PROMPTS, params)]
    with LLM(str(tiny_model_dir), dtype="float32", num_pages=128) as llm:  # a float cache's
        assert [o.text for o in llm.generate(PROMPTS, params)] != want  # differ: the check bites
    for ids, text in zip(PROMPTS, want, strict=True):
        body = {"prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == text
    server.wait_idle(within=10.0)
