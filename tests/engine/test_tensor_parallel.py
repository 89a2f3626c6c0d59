"""Tensor parallelism on CPU (gloo): TP=2 must be token-identical to TP=1 and to transformers,
for dense Qwen3 and for Qwen3-MoE (each rank holds every expert's slice of the MLP)."""

from __future__ import annotations

import random

import psutil
import pytest

from minisgl import LLM, SamplingParams

pytestmark = pytest.mark.timeout(300)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 151643) for _ in range(rng.randint(1, 120))] for _ in range(n)]


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "moe_model_dir"])
def test_tp2_matches_tp1_and_transformers(fixture, request, monkeypatch):
    from test_generate_vs_hf import hf_greedy

    tiny_model_dir = request.getfixturevalue(fixture)
    # The followers subscribe late on purpose: the handshake must still deliver the first step.
    monkeypatch.setenv("MINISGL_TP_SUBSCRIBE_DELAY_S", "1.5")
    prompts = _prompts(6, seed=11)
    params = SamplingParams(temperature=0, max_tokens=8)
    # Kernels pinned ("off"): picks timed on a busy machine differ between the TP=1 and TP=2
    # runs, and float32 sums in another order flip a near-tie token of the random model.
    one = LLM(
        str(tiny_model_dir), dtype="float32", cpu_kernel_tuning="off", num_pages=128
    ).generate(prompts, params)
    with LLM(
        str(tiny_model_dir), dtype="float32", cpu_kernel_tuning="off", num_pages=128, tp_size=2
    ) as tp2:
        followers = [p.pid for p in tp2.engine._procs]
        assert len(followers) == 1 and set(followers) <= _children()
        two = tp2.generate(prompts, params)  # the very first message after start-up
        assert [o.token_ids for o in two] == [o.token_ids for o in one]
        for prompt, out in zip(prompts[:3], two):
            assert out.token_ids == hf_greedy(str(tiny_model_dir), prompt, 8)[0]
        # Seeded sampling agrees across ranks too (each rank samples from gathered logits).
        sampled = SamplingParams(temperature=0.9, seed=7, max_tokens=8)
        assert tp2.generate(prompts[:2], sampled)[0].token_ids == (
            LLM(str(tiny_model_dir), dtype="float32", cpu_kernel_tuning="off", num_pages=64)
            .generate(prompts[:2], sampled)[0]
            .token_ids
        )
        # Every sampling feature crosses to the followers (logit_bias's int keys included)
        # and gives the same tokens and logprobs as one rank. Checked on the dense model: the
        # MoE forward is not yet bit-identical across TP layouts, and a seeded draw over
        # penalised logits can land on the other side of a CDF step (greedy above still holds).
        if fixture == "tiny_model_dir":
            _check_rich_sampling(tp2, str(tiny_model_dir), prompts[2:4])
        engine = tp2.engine
        engine.add_request("g", prompts[0], SamplingParams(max_tokens=30, n=3, ignore_eos=True))
        engine.step()
        engine.abort_request("g", 1)
        engine.abort_request("g")
        while engine.has_unfinished():
            engine.step()
        assert all(s.num_running == 0 and s.num_waiting == 0 for s in engine.rank_stats())
    assert not any(psutil.pid_exists(pid) for pid in followers), "a follower rank still runs"


def test_tp2_abort_frees_pages_on_every_rank(tiny_model_dir):
    with LLM(
        str(tiny_model_dir), dtype="float32", cpu_kernel_tuning="off", num_pages=64, tp_size=2
    ) as tp2:
        engine = tp2.engine
        # Rank 0's ports, the group's store among them (torch's own listener took every
        # interface), listen on the rendezvous address alone.
        ports = {engine.rdv.dist_port, engine.rdv.pub_port, engine.rdv.ack_port}
        assert _listening_addresses(ports) == {"127.0.0.1"}
        long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        for i, prompt in enumerate(_prompts(3, seed=12)):
            engine.add_request(f"r{i}", prompt, long)
        for _ in range(3):
            engine.step()
        engine.abort_request("r1")
        while engine.has_unfinished():
            engine.step()
        stats = engine.rank_stats()
        assert len(stats) == 2
        for s in stats:
            assert s.num_running == 0 and s.num_waiting == 0 and s.num_pages_used == 0
            assert s.num_pages_free + s.num_pages_cached == s.num_pages_total
        assert stats[0] == stats[1]
    # Closed: said so (it was 'rank 1 exited with code 0: its error is printed above ...').
    with pytest.raises(RuntimeError, match="this LLM was shut down"):
        tp2.generate(_prompts(1, seed=13), SamplingParams(max_tokens=2))


def _listening_addresses(ports: set[int]) -> set[str]:
    return {
        c.laddr.ip
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port in ports
    }


def _check_rich_sampling(tp2: LLM, model: str, prompts: list[list[int]]) -> None:
    rich = SamplingParams(temperature=0.9, seed=5, max_tokens=6, n=2, logprobs=3,
                          prompt_logprobs=2, repetition_penalty=1.3, presence_penalty=0.5,
                          logit_bias={11: 3.0})  # fmt: skip
    got = tp2.generate(prompts, rich)
    want = LLM(model, dtype="float32", cpu_kernel_tuning="off", num_pages=64).generate(
        prompts, rich
    )
    for g, w in zip(got, want, strict=True):
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in w.outputs]
        assert g.prompt_logprobs.top_ids == w.prompt_logprobs.top_ids
        diffs = [abs(a - b) for a, b in zip(g.logprobs.logprobs, w.logprobs.logprobs)]
        assert max(diffs) < 1e-4
