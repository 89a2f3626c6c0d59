"""Quantized models under the flags users combine them with: what the start-up log says of
--cpu-quantized-activations int8 matches what the matmuls do."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import pytest
import torch
from quant_parity import needs_amx_vpanel

from minisgl import LLM, SamplingParams
from minisgl.layers import cpu_kernels
from minisgl.layers.kernel_choice import BUCKETS
from minisgl.quant import cpu_choice, cpu_gemv
from minisgl.quant.attach import _holder
from minisgl.quant.quantize import quantize
from minisgl.quant.scheme import load_scheme
from minisgl.quant.weight import QuantWeight
from minisgl.testing.fixture import write_fixture_model
from minisgl.testing.quant_writer import QuantFormat, write_quantized_pair

pytestmark = pytest.mark.timeout(300)
ROUNDED = "x rounded to 8 bits"
UNUSED = "--cpu-quantized-activations int8 unused"
_REQUEST_IDS = itertools.count()


@pytest.fixture(scope="module")
def quant_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The float "quant" checkpoint (every matmul dimension a multiple of 128), written once."""
    return write_fixture_model(tmp_path_factory.mktemp("quant"), "quant")


def _x8_log(path: Path, caplog: pytest.LogCaptureFixture, **flags: str) -> str:
    """The loader's log lines of a model loaded with --cpu-quantized-activations int8."""
    caplog.clear()
    caplog.set_level(logging.INFO, logger="minisgl.models.loader")
    try:
        with LLM(
            str(path),
            dtype="float32",
            num_pages=16,
            cpu_kernel_tuning="off",
            cpu_quantized_activations="int8",
            **flags,
        ):
            pass
    finally:
        cpu_kernels.set_quantized_activations("int16")
    return "\n".join(r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("method", ["int8", "fp8", None])
def test_int8_activations_without_weights_they_take_are_said_unused(
    method: str | None, quant_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # fp8 and float weights (and 8-bit ones without AVX512-VNNI): no matmul rounds x, so the
    # log must not say one does; with VNNI 8-bit weights are rounded, and the log says so.
    # (fp8 with its float head: under --quantization the head is int8 by default.)
    flags = {"quantization": method} if method else {}
    if method == "fp8":
        flags["lm_head_quantization"] = "none"
    log = _x8_log(quant_dir, caplog, **flags)
    if method == "int8" and cpu_gemv.takes_8_bit_codes():
        assert ROUNDED in log and UNUSED not in log
        assert "8- or 4-bit integer codes" in log
        return
    assert ROUNDED not in log
    assert UNUSED in log
    if cpu_kernels.int8_activation_rows():
        assert "the model has no weights in" in log


def test_int8_activations_and_4_bit_groups_of_32(
    quant_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # AWQ in groups of 32 (this model's rows: multiples of 64 inputs): the 8-bit activation
    # kernel takes them in either build (with AVX512-VNNI a scale per lane; without it two
    # groups to a block of x, each half of its lanes scaled by its own group's scale).
    write_quantized_pair(
        quant_dir, tmp_path / "q", tmp_path / "t", QuantFormat("awq", group_size=32)
    )
    log = _x8_log(tmp_path / "q", caplog)
    if cpu_kernels.int8_activation_rows():
        assert ROUNDED in log and UNUSED not in log
    else:  # an AVX-512 build without VNNI, or no C kernels: the exact paths run
        assert UNUSED in log and ROUNDED not in log


@pytest.mark.parametrize("flags", [{"quantization": "int4"}, {"lm_head_quantization": "int4"}])
def test_int8_activations_on_4_bit_weights_are_said_rounded(
    flags: dict[str, str], quant_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A 4-bit LM head alone is enough: its matmul rounds x.
    log = _x8_log(quant_dir, caplog, **flags)
    if cpu_kernels.int8_activation_rows():
        assert ROUNDED in log and UNUSED not in log
    else:  # AVX512-VNNI (or no C kernels): the exact paths run
        assert UNUSED in log and ROUNDED not in log


def _greedy_logprobs(llm: LLM, ids: list[int]) -> list[float]:
    """The greedy tokens' logprobs of `ids` alone (prefill and decode within 64 rows)."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    engine = llm.engine
    engine.add_request(f"req-{next(_REQUEST_IDS)}", ids, params)
    lps: list[float] = []
    while engine.has_unfinished():
        for step in engine.step():
            assert step.error is None, step.error
            lps += [top[0] for top in step.logprobs.top_logprobs]
    return lps


def test_two_models_in_one_process_keep_their_own_int4_activations(quant_dir: Path) -> None:
    """--cpu-quantized-activations is a switch of the C kernels, one per process: a second LLM
    loaded with the exact path must not turn the first one's 8-bit activations off (nor the
    other way round)."""
    ids = [11, 4021, 883, 17, 9, 12001, 64, 3]
    path = str(quant_dir)
    flags = {"dtype": "float32", "num_pages": 16, "cpu_kernel_tuning": "off"}
    try:
        with LLM(path, quantization="int4", cpu_quantized_activations="int8", **flags) as x8:
            before = _greedy_logprobs(x8, ids)
            with LLM(path, quantization="int4", **flags) as exact:
                exact_lp = _greedy_logprobs(exact, ids)
                assert _greedy_logprobs(x8, ids) == before
                assert _greedy_logprobs(exact, ids) == exact_lp
            if cpu_kernels.int8_activation_rows():
                assert before != exact_lp  # the two modes differ here, so the check bites
    finally:
        cpu_kernels.set_quantized_activations("int16")


def test_a_tp_split_inside_an_at_load_group_names_the_flag() -> None:
    """--quantization int4 on a float checkpoint whose shard splits a group of 128 into pieces
    no kernel takes (the MoE fixture's experts, 128 features, under --tp-size 8: groups of 16;
    at --tp-size 2 the ranks hold groups of 64, which load): the refusal names the flag the
    groups come from, not the checkpoint, which has none."""
    with pytest.raises(ValueError, match="--quantization int4's groups of 128") as err:
        _holder(load_scheme("int4"), 128, 16, 128, True, 8)
    assert "checkpoint" not in str(err.value)


def test_untuned_picks_run_8_bit_activations_in_every_row_count_they_take() -> None:
    """Untuned (--cpu-kernel-tuning off, or timings too disturbed to keep), 4-bit weights under
    --cpu-quantized-activations int8 run qgemv, the kernel that rounds x, for every row count the
    flag takes (up to 64): the fp32 panel from 17 rows left the flag unused in decode batches
    of 17-64 (and slower: qgemv with 8-bit x took 0.65-0.86x the panel's time there on the
    AVX2 EPYC VM, 1 thread). Where the build has x8_panel (qvnni.c), which rounds x too, it
    takes more rows, and some of those from fewer rows; else the exact path's picks."""
    w = quantize(torch.randn(256, 256) * 0.02, load_scheme("int4"))
    rows = cpu_kernels.x8_gemv_rows()
    lib = cpu_kernels.load()
    many = "x8_panel" if lib is not None and lib.qvnni else None
    try:
        cpu_kernels.set_quantized_activations("int8")
        picks = cpu_choice.choose([w], torch.float32, "off")
    finally:
        cpu_kernels.set_quantized_activations("int16")
    exact = cpu_choice.choose([w], torch.float32, "off")
    assert picks is not None and exact is not None
    for (first, last), pick, exact_pick in zip(BUCKETS, picks[0], exact[0], strict=True):
        if last is not None and last <= rows:  # a kernel that rounds x, whichever
            assert pick in (("qgemv", "x8_panel") if many else ("qgemv",)), (first, last, picks)
        else:  # beyond the GEMV's rows: the many-row x8 kernel, or the exact path's picks
            assert pick == (many or exact_pick)
    # int8 codes: with AVX512-VNNI the same (qgemv for every row count the flag takes),
    # without it their picks stay the exact path's
    w8 = quantize(torch.randn(256, 256) * 0.02, load_scheme("int8"))
    try:
        cpu_kernels.set_quantized_activations("int8")
        picks8 = cpu_choice.choose([w8], torch.float32, "off")
    finally:
        cpu_kernels.set_quantized_activations("int16")
    exact8 = cpu_choice.choose([w8], torch.float32, "off")
    assert picks8 is not None and exact8 is not None
    if not cpu_gemv.takes_8_bit_codes():
        assert picks8 == exact8
        return
    for (_first, last), pick, exact_pick in zip(BUCKETS, picks8[0], exact8[0], strict=True):
        if last is not None and last <= rows:
            assert pick in (("qgemv", "x8_panel") if many else ("qgemv",))
        else:
            assert pick == (many or exact_pick)


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_a_prefill_past_64_rows_runs_8_bit_activations_and_keeps_the_tokens(
    method: str, quant_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 100-token prompt under --cpu-quantized-activations int8 (untuned picks): its prefill
    runs x8_panel (qvnni.c) where the build has it, so the first token's logprob moves off the
    exact mode's; the greedy tokens stay the exact mode's but where its top two nearly tie."""
    ran: list[int] = []
    real = cpu_choice._RUN["x8_panel"]
    monkeypatch.setitem(
        cpu_choice._RUN, "x8_panel", lambda x, w, o=None: ran.append(x.shape[0]) or real(x, w, o)
    )
    ids = torch.randint(5, 4000, (100,), generator=torch.Generator().manual_seed(7)).tolist()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    runs: dict[str, tuple[list[int], list[list[float]]]] = {}
    flags = {"dtype": "float32", "num_pages": 16, "cpu_kernel_tuning": "off"}
    try:
        for mode in ("int16", "int8"):
            with LLM(
                str(quant_dir), quantization=method, cpu_quantized_activations=mode, **flags
            ) as llm:
                engine = llm.engine
                engine.add_request(f"long-{mode}-{next(_REQUEST_IDS)}", ids, params)
                tokens: list[int] = []
                tops: list[list[float]] = []
                while engine.has_unfinished():
                    for step in engine.step():
                        assert step.error is None, step.error
                        tokens += step.new_token_ids
                        tops += [list(top) for top in step.logprobs.top_logprobs]
                runs[mode] = (tokens, tops)
    finally:
        cpu_kernels.set_quantized_activations("int16")
    (exact, exact_tops), (ours, our_tops) = runs["int16"], runs["int8"]
    j = next((j for j, (a, b) in enumerate(zip(exact, ours)) if a != b), None)
    assert len(ours) == 4
    assert j is None or exact_tops[j][0] - exact_tops[j][1] <= 1.0, (j, exact, ours, exact_tops)
    lib = cpu_kernels.load()
    x8 = lib is not None and bool(lib.qvnni) and (method == "int4" or cpu_gemv.takes_8_bit_codes())
    assert (max(ran, default=0) >= 100) == x8  # the prefill's rows went through it
    if x8:
        assert our_tops[0][0] != exact_tops[0][0]


def _x8_run(
    path: Path, method: str, pick: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[int], list[list[float]]]:
    """Greedy tokens and top logprobs of a 100-token prompt (a 100-row prefill, then decode
    steps of one row through the decode chain) under --cpu-quantized-activations int8 with
    every quantized weight on `pick`."""
    monkeypatch.setenv("MINISGL_CPU_QUANT_LINEAR", pick)
    ids = torch.randint(5, 4000, (100,), generator=torch.Generator().manual_seed(11)).tolist()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    flags = {"dtype": "bfloat16", "num_pages": 16, "cpu_kernel_tuning": "off"}
    tokens: list[int] = []
    tops: list[list[float]] = []
    try:
        with LLM(str(path), quantization=method, cpu_quantized_activations="int8", **flags) as llm:
            engine = llm.engine
            weights = [m for m in engine.runner.model.modules() if isinstance(m, QuantWeight)]
            picks = {p for w in weights for p in (w.kernel.picks if w.kernel else ())}
            assert picks == {pick}, picks  # every weight packed and on `pick` in every bucket
            engine.add_request(f"x8-{pick}-{next(_REQUEST_IDS)}", ids, params)
            while engine.has_unfinished():
                for step in engine.step():
                    assert step.error is None, step.error
                    tokens += step.new_token_ids
                    tops += [list(top) for top in step.logprobs.top_logprobs]
    finally:
        cpu_kernels.set_quantized_activations("int16")
    return tokens, tops


@needs_amx_vpanel
@pytest.mark.parametrize("method", ["int4", "int8"])
def test_8_bit_activations_on_amx_tiles_give_the_vnni_panels_tokens_and_logprobs(
    method: str, quant_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under --cpu-quantized-activations int8 the packed panels' AMX-INT8 form rounds x as
    vnni_panel's 8-bit form does and sums the same integers: a whole model on either gives the
    same tokens and the same logprobs, prefill and decode."""
    on_tiles = _x8_run(quant_dir, method, "amx_vpanel", monkeypatch)
    on_vnni = _x8_run(quant_dir, method, "vnni_panel", monkeypatch)
    assert len(on_tiles[0]) == 6
    assert on_tiles == on_vnni
