"""Structured outputs with `--tp-size 2` on CPU (gloo), on one node and over two: rank 0
compiles each grammar off its loop and sends it to the other rank with the request, so both
ranks mask alike and the tokens are those of one rank; a grammar that fails ends only its own
request."""

from __future__ import annotations

import json
import signal

import httpx
import pytest
from harness import ServerProcess
from test_multinode import Group

from minisgl import LLM, SamplingParams

pytestmark = pytest.mark.timeout(900)

PROMPT = [785, 6722, 315, 9625, 374, 1045, 2001, 77, 3000]
SCHEMAS = [
    {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
    {
        "type": "object",
        "properties": {"s": {"type": "string", "maxLength": 6}, "b": {"type": "boolean"}},
        "required": ["s", "b"],
    },
]


def _body(schema: dict) -> dict:
    return {
        "model": "m",
        "prompt": PROMPT,
        "max_tokens": 24,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }


def _one_rank(model_dir) -> list[str]:
    llm = LLM(str(model_dir), dtype="float32", num_pages=64)
    want = [
        llm.generate(
            [PROMPT],
            SamplingParams(
                temperature=0, max_tokens=24, grammar_kind="json_schema", grammar=json.dumps(s)
            ),
        )[0].text
        for s in SCHEMAS
    ]
    llm.shutdown()
    return want


def test_tp2_constrained_outputs_match_one_rank(tiny_model_dir, tmp_path) -> None:
    want = _one_rank(tiny_model_dir)
    server = ServerProcess(
        tiny_model_dir, tmp_path / "tp2.log", "--tp-size", "2", "--num-pages", "64"
    )
    try:
        server.wait_ready()
        url = f"{server.url}/v1/completions"
        for _ in range(2):  # the second time from every rank's cache
            got = [httpx.post(url, json=_body(s), timeout=600) for s in SCHEMAS]
            assert [r.status_code for r in got] == [200, 200], [r.text for r in got]
            assert [r.json()["choices"][0]["text"] for r in got] == want
        bad = httpx.post(
            url, json={"model": "m", "prompt": PROMPT, "max_tokens": 4, "regex": "("}, timeout=600
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "regex"
        r = httpx.post(url, json=_body(SCHEMAS[1]), timeout=600)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[1]
    finally:
        server.signal(signal.SIGTERM)
        code = server.proc.wait(60)
    assert code == 0, server.logs()
    # No rank analysed the vocabulary itself: the compile worker did, and rank 1 got its copy.
    assert "xgrammar ready" not in server.logs()


def test_two_nodes_constrained_outputs_match_one_rank(tiny_model_dir, tmp_path) -> None:
    want = _one_rank(tiny_model_dir)
    group = Group(tiny_model_dir, tmp_path)
    try:
        group.wait_ready()
        url = f"{group.node0.url}/v1/completions"
        got = [httpx.post(url, json=_body(s), timeout=600) for s in SCHEMAS]
        assert [r.status_code for r in got] == [200, 200], [r.text for r in got]
        assert [r.json()["choices"][0]["text"] for r in got] == want
    finally:
        group.stop()
    node1 = (tmp_path / "node1.log").read_text(errors="replace")
    assert "xgrammar ready" not in node1  # node 1 got rank 0's compiled grammars
