"""--quantization int8|int4|fp8 quantizes a float checkpoint's linears as they load, and the LM
head (int8 per channel unless --lm-head-quantization says otherwise; tied, the embedding table
with it, stored once): the model holds only their quantized bytes, and generates exactly the
tokens of a float checkpoint of the quantized-then-dequantized weights."""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from quant_parity import (
    MAX_TOKENS,
    assert_agree,
    greedy,
    needs_amx_vpanel,
    needs_fp8_panel,
    needs_vnni_panel,
    prompts,
    source,
)

from minisgl import LLM, SamplingParams
from minisgl.layers import cpu_kernels
from minisgl.quant import cpu_gemv
from minisgl.quant.qtensor import dequantize
from minisgl.quant.quantize import quantize
from minisgl.quant.scheme import head_scheme, load_scheme
from minisgl.quant.weight import QuantWeight
from minisgl.testing.presets import VOCAB_SIZE
from minisgl.testing.quant_writer import LINEAR, QuantFormat, write_quantized_pair

pytestmark = pytest.mark.timeout(300)
HIDDEN = 128  # the "quant" preset's
# Logprob gap under which x in 8 bits (--cpu-quantized-activations int8) may pick the other of two
# candidates: its rounding moved this random model's top-two gaps by up to 0.57 (measured; its
# logits are larger than a trained model's).
X8_TIE = 1.0


def _twin(method: str, out: Path, tied: bool = True, head: str = "int8") -> Path:
    """The float checkpoint of what --quantization `method` makes of the source's weights: its
    linears, and its LM head as --lm-head-quantization `head` makes it (the embedding table
    too where it is the head; an untied embedding stays float)."""
    from safetensors.torch import load_file, save_file

    src = source("quant", tied)
    shutil.copytree(src, out)
    tensors = load_file(src / "model.safetensors")
    head_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    for name, t in tensors.items():
        if LINEAR.fullmatch(name) and method != "none":
            tensors[name] = dequantize(quantize(t, load_scheme(method)), torch.float32)
        elif name == head_name and head != "none":
            tensors[name] = dequantize(quantize(t, head_scheme(head)), torch.float32)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def _assert_twin_tokens(
    tmp: Path,
    method: str,
    *,
    dtype: str = "float32",
    tied: bool = True,
    head: str = "int8",
    **flags: str,
) -> None:
    """The source loaded with `flags` generates the greedy tokens of `_twin(method, head)`."""
    ours, _ = greedy(source("quant", tied), dtype=dtype, **flags)
    reference, gaps = greedy(_twin(method, tmp / "twin", tied, head), dtype=dtype)
    assert_agree(reference, ours, gaps, dtype)


# int4 in bf16: the prefill chunks past 16 rows run the AMX panel where the CPU has it (each
# 4-bit (row, group) looked up in a bf16 table): the twin's weights rounded to bf16 are those
# values, so the tokens are the twin's.
@pytest.mark.parametrize(
    ("method", "dtype"),
    [("int8", "float32"), ("int4", "float32"), ("fp8", "float32"), ("int4", "bfloat16")],
)
def test_greedy_tokens_equal_the_quantized_then_dequantized_weights(
    method: str, dtype: str, tmp_path: Path
) -> None:
    _assert_twin_tokens(tmp_path, method, dtype=dtype, quantization=method)


def test_an_untied_head_is_quantized_and_its_embedding_stays_float(tmp_path: Path) -> None:
    # fp8 layers with the int8 head: the head's format is its own, not the layers'.
    _assert_twin_tokens(tmp_path, "fp8", tied=False, quantization="fp8")


def _vocab_tables(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every float copy of the vocabulary table the model holds (a quantized table's codes are
    not float; its per-row scales are [V, 1])."""
    tensors = [*model.parameters(), *model.buffers()]
    return [t for t in tensors if t.is_floating_point() and tuple(t.shape) == (VOCAB_SIZE, HIDDEN)]


def _load(**flags: str) -> LLM:
    """The source, small (16 KV pages), loaded with `flags` to look at what the model holds."""
    return LLM(
        str(source("quant")), dtype="float32", num_pages=16, cpu_kernel_tuning="off", **flags
    )


def test_only_quantized_bytes_are_held(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="minisgl.models.loader")
    with _load(quantization="int4") as llm:
        model = llm.engine.runner.model
        held = list(dict.fromkeys(m for m in model.modules() if isinstance(m, QuantWeight)))
        # qkv, o, gate_up, down in each of the 2 layers, and the (tied) LM head
        assert len(held) == 2 * 4 + 1
        # No float copy of a quantized layer: its only tensors are the codes and scales.
        for m in model.modules():
            if hasattr(m, "weight") and isinstance(m.weight, QuantWeight):
                assert not list(m.parameters(recurse=False))
        # The tied table is stored once, as the head's int8 codes; nothing float of its size.
        head, embed = model.lm_head.weight, model.model.embed_tokens.weight
        assert isinstance(head, QuantWeight) and embed is head
        assert head.codes.dtype == torch.uint8 and tuple(head.codes.shape) == (VOCAB_SIZE, HIDDEN)
        assert _vocab_tables(model) == []
        codes = sum(m.codes.numel() * m.codes.element_size() for m in held if m is not head)
        # per layer qkv 512x128, o 128x256, gate_up 512x128, down 128x256; 4 bits each
        assert codes == 2 * (512 * 128 + 128 * 256 + 512 * 128 + 128 * 256) // 2
        # The embedding lookup reads the dequantized rows of the table.
        ids = torch.tensor([0, 7, VOCAB_SIZE - 1])
        want = dequantize(head.view(), torch.float32)[ids]
        assert torch.equal(model.model.embed_tokens(ids), want)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("weights:"))
    assert "int4 4-bit, group 128, zero points (quantized at load)" in line
    assert "LM head: int8 8-bit, per channel" in line
    quantized_mib = float(re.search(r"([\d.]+) MiB quantized", line).group(1))
    float_mib = float(re.search(r"([\d.]+) MiB float", line).group(1))
    # 151936 x 128 head codes (18.5 MiB) + their scales and zero points + the layers' 0.2 MiB;
    # in float32 the table alone would be 74 MiB.
    assert 18.5 < quantized_mib < 20
    assert float_mib < 0.1  # norms


def test_lm_head_quantization_none_keeps_the_head_float(tmp_path: Path) -> None:
    with _load(quantization="int8", lm_head_quantization="none") as llm:
        model = llm.engine.runner.model
        head, embed = model.lm_head, model.model.embed_tokens
        assert not isinstance(head.weight, QuantWeight)
        assert head.weight is embed.weight and head.weight.dtype == torch.float32
        assert sum(isinstance(m, QuantWeight) for m in model.modules()) == 2 * 4
        assert len(_vocab_tables(model)) == 1


def test_lm_head_quantization_alone_quantizes_a_float_model_head(tmp_path: Path) -> None:
    # No --quantization: the layers stay float, the head is quantized as asked (int4 here).
    _assert_twin_tokens(tmp_path, "none", head="int4", lm_head_quantization="int4")


def test_a_quantized_checkpoint_refuses_the_flag(tmp_path: Path) -> None:
    write_quantized_pair(source("quant"), tmp_path / "q", tmp_path / "t", QuantFormat("awq"))
    with pytest.raises(ValueError, match="--quantization int8 is for float checkpoints"):
        LLM(str(tmp_path / "q"), dtype="float32", cpu_kernel_tuning="off", quantization="int8")


def _one_at_a_time(path: Path, **flags: str) -> tuple[list[list[int]], list[list[float]]]:
    """Each prompt alone (its prefill and decode steps within the 64 rows
    --cpu-quantized-activations int8 takes): its greedy tokens and their top-two logprob gaps."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    tokens: list[list[int]] = []
    gaps: list[list[float]] = []
    with LLM(str(path), dtype="float32", num_pages=64, cpu_kernel_tuning="off", **flags) as llm:
        engine = llm.engine
        for i, ids in enumerate(prompts()):
            engine.add_request(f"alone-{i}", ids, params)
            tokens.append([])
            gaps.append([])
            while engine.has_unfinished():
                for step in engine.step():
                    assert step.error is None, step.error
                    tokens[-1] += step.new_token_ids
                    gaps[-1] += [top[0] - top[1] for top in step.logprobs.top_logprobs]
        assert cpu_kernels.quantized_activations() == flags.get(
            "cpu_quantized_activations", "int16"
        )
    return tokens, gaps


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_activations_in_8_bits_keep_the_tokens_but_near_ties(
    method: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """--cpu-quantized-activations int8 rounds x to 8 bits per block of at most 128 features
    in integer weights' matmuls of up to 64 rows (4-bit everywhere, 8-bit with AVX512-VNNI):
    not exact, so a token may differ from the dequantized twin's where the twin's top two
    candidates nearly tie, and nowhere else; the start-up log says so."""
    caplog.set_level(logging.INFO, logger="minisgl.models.loader")
    reference, gaps = _one_at_a_time(_twin(method, tmp_path / "twin"))
    try:
        ours, our_gaps = _one_at_a_time(
            source("quant"), quantization=method, cpu_quantized_activations="int8"
        )
    finally:
        cpu_kernels.set_quantized_activations("int16")
    rounds = cpu_kernels.int8_activation_rows() and (
        method == "int4" or cpu_gemv.takes_8_bit_codes()
    )
    for want, got, gap, our_gap in zip(reference, ours, gaps, our_gaps, strict=True):
        j = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), None)
        assert j is None or gap[j] <= X8_TIE, (j, want, got, gap)
        assert len(got) == MAX_TOKENS
        same = len(want) if j is None else j  # the gaps of the same tokens moved by little
        assert all(abs(a - b) <= X8_TIE for a, b in zip(gap[:same], our_gap[:same]))
    if rounds:
        assert our_gaps != gaps  # x was rounded: the switch took effect
    else:  # 8-bit codes without VNNI (or no C kernels): exact paths, the flag changes nothing
        assert ours == reference
    assert any("--cpu-quantized-activations int8" in r.getMessage() for r in caplog.records)


@needs_vnni_panel
@pytest.mark.parametrize(
    ("method", "dtype"),
    [
        ("int8", "float32"),
        ("int4", "float32"),
        ("int4", "bfloat16"),
        pytest.param("fp8", "bfloat16", marks=needs_fp8_panel),
    ],
)
def test_vnni_panels_generate_the_twins_tokens(
    method: str, dtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every quantized weight repacked into VNNI panels (the tied head too, its lookups
    gathered out of the panels; fp8 codes into their bf16-product panels): the twin's greedy
    tokens, batched, with prefix hits and chunked prefill as quant_parity runs them."""
    monkeypatch.setenv("MINISGL_CPU_QUANT_LINEAR", "vnni_panel")
    _assert_twin_tokens(tmp_path, method, dtype=dtype, quantization=method)


@needs_amx_vpanel
@pytest.mark.parametrize("pick", ["amx_vpanel", "amx_bf16_vpanel"])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_panels_on_amx_tiles_generate_the_twins_tokens(
    method: str, pick: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every quantized weight packed and multiplied on AMX tiles at every row count (prefill
    chunks, decode batches and the decode chain's C calls), exact (AMX-INT8) or dequantized
    to bf16: the twin's greedy tokens, batched, with prefix hits and chunked prefill."""
    monkeypatch.setenv("MINISGL_CPU_QUANT_LINEAR", pick)
    _assert_twin_tokens(tmp_path, method, dtype="bfloat16", quantization=method)


@needs_fp8_panel
def test_an_fp8_head_in_panels_serves_its_embedding_lookups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tied table in fp8 (--lm-head-quantization fp8) packed for its LM head: the prompt's
    and each step's embedding rows come out of the fp8 panels (C in the decode chain, torch
    for prefill), and the tokens are the twin's."""
    monkeypatch.setenv("MINISGL_CPU_QUANT_LINEAR", "vnni_panel")
    _assert_twin_tokens(
        tmp_path,
        "fp8",
        dtype="bfloat16",
        head="fp8",
        quantization="fp8",
        lm_head_quantization="fp8",
    )


@needs_vnni_panel
def test_vnni_panels_replace_the_codes_in_place(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Packed, a weight holds the same bytes in the same buffers (no second copy), every one
    is packed, the start-up line names the pick, and the tied table's lookups are the
    row-major table's rows."""
    with _load(quantization="int4") as llm:
        model = llm.engine.runner.model
        before = sorted(m.nbytes() for m in model.modules() if isinstance(m, QuantWeight))
        ids = torch.tensor([0, 7, VOCAB_SIZE - 1])
        want = model.model.embed_tokens(ids)
    caplog.set_level(logging.INFO, logger="minisgl.models.loader")
    monkeypatch.setenv("MINISGL_CPU_QUANT_LINEAR", "vnni_panel")
    with _load(quantization="int4") as llm:
        model = llm.engine.runner.model
        held = [m for m in model.modules() if isinstance(m, QuantWeight)]
        assert held and all(m.packed for m in held)
        assert sorted(m.nbytes() for m in held) == before
        assert torch.equal(model.model.embed_tokens(ids), want)
    line = next(r.getMessage() for r in caplog.records if "quantized matmul" in r.getMessage())
    assert "[1+:vnni_panel]" in line
