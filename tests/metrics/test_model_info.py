"""minisgl_model_info's labels for what the scheduler loaded (weights_info): the layers'
format, the LM head's (a float model's head can be quantized alone) and whether integer weights
round their input to 8 bits (--cpu-quantized-activations int8)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from metrics_text import parse

from minisgl import LLM
from minisgl.layers import cpu_kernels
from minisgl.metrics import ServerMetrics
from minisgl.metrics import names as n
from minisgl.quant import cpu_gemv
from minisgl.quant.loading import weights_info

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def quant_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from minisgl.testing.fixture import write_fixture_model

    # Hidden 128 and MLP 256: whole groups of 128, which 8-bit activations take.
    return write_fixture_model(tmp_path_factory.mktemp("quant"), "quant")


@pytest.fixture(autouse=True)
def exact_activations_after() -> Iterator[None]:
    yield
    cpu_kernels.set_quantized_activations("int16")  # process-wide: the next test starts exact


def _info(path: Path, **flags: str) -> dict:
    with LLM(str(path), dtype="float32", num_pages=16, cpu_kernel_tuning="off", **flags) as llm:
        engine = llm.engine
        return weights_info(
            engine.runner.model,
            engine.model_config,
            flags.get("quantization"),
            flags.get("lm_head_quantization", "auto"),
        )


def test_a_float_model_says_none_everywhere(tiny_model_dir: Path) -> None:
    info = _info(tiny_model_dir)
    assert (info["quantization"], info["lm_head"], info["activations"]) == (
        "none",
        "none",
        "exact",
    )


def test_a_float_model_with_only_its_head_quantized_says_so(tiny_model_dir: Path) -> None:
    info = _info(tiny_model_dir, lm_head_quantization="int8")
    assert (info["quantization"], info["lm_head"]) == ("none", "int8")


def test_int4_says_its_head_and_whether_activations_are_rounded(quant_model_dir: Path) -> None:
    info = _info(quant_model_dir, quantization="int4", cpu_quantized_activations="int8")
    assert (info["quantization"], info["lm_head"]) == ("int4", "int8")  # auto head: int8
    assert info["activations"] == ("int8" if cpu_kernels.int8_activation_rows() else "exact")
    exact = _info(quant_model_dir, quantization="int4", lm_head_quantization="none")
    assert (exact["lm_head"], exact["activations"]) == ("none", "exact")


def test_int8_activations_round_8_bit_weights_where_vnni_takes_them(quant_model_dir: Path) -> None:
    # With AVX512-VNNI 8-bit codes take x in 8 bits too; without it they stay exact. The old
    # keyword (--cpu-int4-activations) still sets it.
    info = _info(quant_model_dir, quantization="int8", cpu_int4_activations="int8")
    rounded = "int8" if cpu_gemv.takes_8_bit_codes() else "exact"
    assert (info["quantization"], info["activations"]) == ("int8", rounded)


def test_the_info_gauge_carries_the_labels() -> None:
    m = ServerMetrics("m")
    m.set_model("none", "bfloat16", 10, lm_head="int8", activations="exact", kv_cache="fp8_e4m3")
    (sample,) = parse(m.render()[0])[n.MODEL_INFO][1]
    assert sample.value == 1
    assert sample.labels == {
        "model_name": "m",
        "quantization": "none",
        "dtype": "bfloat16",
        "lm_head": "int8",
        "activations": "exact",
        "kv_cache": "fp8_e4m3",
    }
