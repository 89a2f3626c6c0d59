"""`python -m minisgl.bench` against a local OpenAI-compatible stub with known timings."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from openai_stub import MODEL, StubState, serve_stub

from minisgl.bench.cli import build_parser, main, run
from minisgl.bench.client import RequestResult
from minisgl.bench.dataset import random_requests, sample_lengths
from minisgl.bench.summary import summarize

REPO = Path(__file__).resolve().parents[2]


def test_cli_module_reports_exact_counts_and_timings(tmp_path: Path) -> None:
    state = StubState(delay_s=0.005)
    out = tmp_path / "result.json"
    with serve_stub(state) as url:
        proc = subprocess.run(
            [sys.executable, "-m", "minisgl.bench", "--base-url", url, "--num-prompts", "6",
             "--max-concurrency", "2", "--random-input-len", "12", "--random-output-len", "5",
             "--seed", "3", "--output-file", str(out), "--disable-tqdm"],
            capture_output=True, text=True, timeout=60, cwd=REPO,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Serving Benchmark Result" in proc.stdout and "Mean TTFT (ms)" in proc.stdout
    record = json.loads(out.read_text())
    assert record["model"] == MODEL  # taken from /v1/models
    assert record["completed"] == 6 and record["failed"] == 0
    assert record["total_output_tokens"] == 6 * 5  # ignore_eos + max_tokens: exact
    assert record["total_input_tokens"] == 6 * 12  # the stub counts words
    assert record["output_throughput"] == pytest.approx(30 / record["duration"])
    # One chunk every 5 ms: TTFT, ITL and TPOT are at least that, E2E at least 5 chunks.
    for key in ("mean_ttft_ms", "median_itl_ms", "p99_itl_ms", "mean_tpot_ms"):
        assert record[key] >= 5.0, key
    assert record["mean_e2e_latency_ms"] >= 25.0
    assert record["mean_itl_ms"] < 200 and record["mean_tpot_ms"] < 200
    # One warm-up request, then the six measured ones, never more than two at once.
    assert len(state.bodies) == 7 and state.peak_streams == 2
    body = state.bodies[-1]
    assert body["stream"] and body["ignore_eos"] and body["max_tokens"] == 5
    assert body["model"] == MODEL and len(body["prompt"].split()) == 12


def test_chat_backend_poisson_arrivals_and_extra_body() -> None:
    state = StubState(delay_s=0.001)
    rate, n, seed = 40.0, 8, 11
    with serve_stub(state) as url:
        record = run(build_parser().parse_args(
            ["--base-url", url, "--backend", "chat", "--model", "m", "--num-prompts", str(n),
             "--request-rate", str(rate), "--random-input-len", "4", "--random-output-len", "3",
             "--seed", str(seed), "--warmup-requests", "0", "--disable-tqdm",
             "--extra-request-body", '{"top_k": 1}', "--disable-ignore-eos"]
        ))  # fmt: skip
    assert record["completed"] == n and record["request_rate"] == rate
    assert len(state.bodies) == n
    assert all(b["messages"][0]["role"] == "user" and b["top_k"] == 1 for b in state.bodies)
    assert not any("ignore_eos" in b for b in state.bodies)
    # Arrivals follow the seeded exponential gaps, so the run lasts at least their sum.
    rng = random.Random(seed)
    gaps = sum(rng.expovariate(rate) for _ in range(n - 1))
    assert record["duration"] >= gaps > 0.05


def test_failed_requests_are_counted_and_exit_nonzero(tmp_path: Path) -> None:
    # Lengths 2..10; the stub refuses more than 6 tokens.
    state = StubState(max_tokens_limit=6)
    out = tmp_path / "r.json"
    with serve_stub(state) as url:
        rc = main(
            ["--base-url", url, "--num-prompts", "20", "--random-output-len", "10",
             "--random-range-ratio", "0.2", "--random-input-len", "3", "--warmup-requests", "0",
             "--disable-tqdm", "--output-file", str(out), "--output-details"]
        )  # fmt: skip
    record = json.loads(out.read_text())
    refused = sum(1 for b in state.bodies if b["max_tokens"] > 6)
    assert 0 < refused < 20 and rc == 1
    assert record["failed"] == refused and record["completed"] == 20 - refused
    assert any("HTTP 400" in e for e in record["errors"])
    assert record["total_output_tokens"] == sum(
        b["max_tokens"] for b in state.bodies if b["max_tokens"] <= 6
    )
    assert len(record["details"]) == 20


def test_summary_matches_hand_computed_numbers() -> None:
    ok = RequestResult(success=True, prompt_len=10, output_len=5, ttft=0.2, latency=1.0,
                       itl=[0.2, 0.2, 0.2, 0.2])  # fmt: skip
    one = RequestResult(success=True, prompt_len=4, output_len=1, ttft=0.1, latency=0.1)
    bad = RequestResult(success=False, error="x")
    s = summarize([ok, one, bad], duration_s=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["request_throughput"] == 1.0
    assert s["input_throughput"] == 7.0 and s["output_throughput"] == 3.0
    assert s["mean_tpot_ms"] == pytest.approx(200.0)  # (1.0 - 0.2) / 4, one-token one excluded
    assert s["mean_ttft_ms"] == pytest.approx(150.0) and s["median_itl_ms"] == pytest.approx(200)
    assert s["p99_e2e_latency_ms"] == pytest.approx(991.0)
    empty = summarize([], duration_s=1.0)
    assert empty["completed"] == 0 and empty["mean_ttft_ms"] is None


def test_random_prompts_are_reproducible_and_sized() -> None:
    a = random_requests(5, 30, 7, 0.5, seed=4)
    assert a == random_requests(5, 30, 7, 0.5, seed=4)
    assert a != random_requests(5, 30, 7, 0.5, seed=5)
    assert all(15 <= r.prompt_len <= 30 and 3 <= r.output_len <= 7 for r in a)
    assert all(len(r.prompt.split()) == r.prompt_len for r in a)
    assert sample_lengths(random.Random(0), 4, 9, 1.0) == [9, 9, 9, 9]
    with pytest.raises(ValueError):
        sample_lengths(random.Random(0), 1, 9, 1.5)


def test_prompts_from_a_local_tokenizer_have_the_requested_token_count(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"tok{i}": i for i in range(50)} | {"[UNK]": 50}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    tok.add_special_tokens(["[UNK]"])
    tok.save(str(tmp_path / "tokenizer.json"))
    reqs = random_requests(4, 16, 2, 1.0, seed=1, tokenizer=str(tmp_path))
    for r in reqs:
        assert len(tok.encode(r.prompt).ids) == 16 == r.prompt_len
        assert "[UNK]" not in r.prompt
