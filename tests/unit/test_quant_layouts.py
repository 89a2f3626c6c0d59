"""The published quantized layouts read into exactly the weights they encode, and anything minisgl
would not use (an unknown method, bit width or layout, a stray scale tensor) refused at start.

The checkpoint tensors come from minisgl.testing.quant_writer, which packs them with plain loops
following each format's specification; the loader unpacks with its own vectorised code."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minisgl.quant import matmul
from minisgl.quant.formats import read_linear
from minisgl.quant.layout import scan
from minisgl.quant.matmul import qlinear
from minisgl.quant.qtensor import dequantize
from minisgl.quant.quantize import quantize
from minisgl.quant.scheme import load_scheme, parse_quantization_config
from minisgl.testing import quant_writer
from minisgl.testing.quant_writer import QuantFormat

N, K = 256, 384  # output, input features

FORMATS = {
    "fp8 block": QuantFormat("fp8"),
    "ct fp8 channel": QuantFormat("ct-fp8-channel"),
    "ct fp8 tensor": QuantFormat("ct-fp8-tensor"),
    "awq g128": QuantFormat("awq"),
    "awq g64": QuantFormat("awq", group_size=64),
    "gptq 4 sym g128": QuantFormat("gptq"),
    "gptq 4 asym g64": QuantFormat("gptq", group_size=64, sym=False),
    "gptq 4 asym g32 desc_act": QuantFormat("gptq", group_size=32, sym=False, desc_act=True),
    "gptq 4 sym g-1": QuantFormat("gptq", group_size=-1),
    "gptq 8 sym g32": QuantFormat("gptq", bits=8, group_size=32),
    "gptq 8 asym g128 desc_act": QuantFormat("gptq", bits=8, sym=False, desc_act=True),
    "gptq_v2 4 asym g128": QuantFormat("gptq", sym=False, gptq_v2=True),
    # compressed-tensors integer weights, as llm-compressor writes its W4A16 / W8A16 / W8A8
    "ct w4a16 sym g128": QuantFormat("ct-pack"),
    "ct w4a16 asym g64": QuantFormat("ct-pack", group_size=64, sym=False),
    "ct w4a16 asym channel": QuantFormat("ct-pack", group_size=-1, sym=False),
    "ct w4a16 g32 actorder group": QuantFormat("ct-pack", group_size=32, desc_act=True),
    "ct w8a16 sym channel": QuantFormat("ct-pack", bits=8, group_size=-1),
    "ct w8a16 asym g128": QuantFormat("ct-pack", bits=8, sym=False),
    "ct w8a8 channel": QuantFormat("ct-int8", bits=8, group_size=-1),
    "ct w8a8 tensor": QuantFormat("ct-int8", bits=8, group_size=0),
    "ct w8a8 asym g128": QuantFormat("ct-int8", bits=8, sym=False),
    # Intel AutoRound's exports: GPTQ's (v1) and AutoAWQ's layouts under its own config
    "auto-round gptq 4 sym g128": QuantFormat("gptq", auto_round=True),
    "auto-round gptq 4 sym, zeros as they are": QuantFormat("gptq", auto_round=True, gptq_v2=True),
    "auto-round gptq 4 asym g64": QuantFormat("gptq", group_size=64, sym=False, auto_round=True),
    "auto-round gptq 8 sym g128": QuantFormat("gptq", bits=8, auto_round=True),
    "auto-round awq g128": QuantFormat("awq", sym=False, auto_round=True),
}
CT_FORMATS = [name for name in FORMATS if name.startswith("ct w")]


def _weight(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 0.5, (N, K)).astype(np.float32)


def _encode(fmt: QuantFormat, w: np.ndarray) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    rng = np.random.default_rng(1)
    if fmt.method == "awq":
        parts, twin = quant_writer._awq(w, fmt)
    elif fmt.method in ("gptq", "ct-pack", "ct-int8"):
        order = rng.permutation(K) if fmt.desc_act else np.arange(K)
        encode = quant_writer._gptq if fmt.method == "gptq" else quant_writer._ct_int
        parts, twin = encode(w, fmt, order)
    else:
        parts, twin = quant_writer._fp8(w, fmt)
    tensors = {
        k: v if isinstance(v, torch.Tensor) else torch.from_numpy(v) for k, v in parts.items()
    }
    return tensors, torch.from_numpy(np.asarray(twin, dtype=np.float32))


@pytest.mark.parametrize("name", list(FORMATS))
def test_layout_reads_into_the_encoded_weights(name: str) -> None:
    fmt = FORMATS[name]
    scheme = parse_quantization_config(fmt.quantization_config())
    assert scheme is not None
    parts, twin = _encode(fmt, _weight())
    q = read_linear("model.layers.0.mlp.down_proj", parts, scheme)
    assert q.shape == (N, K)
    assert torch.equal(dequantize(q, torch.float32), twin)
    # Held as the quantized bytes: codes, an fp32 scale (and a byte of zero point) per group.
    groups = -(-K // scheme.group_size) if scheme.group_size else 1
    assert q.nbytes() <= N * K * scheme.bits // 8 + N * groups * 5 + K * 4
    # Tensor-parallel shards: rows, and input features on group boundaries.
    assert torch.equal(dequantize(q.narrow(0, 64, 128), torch.float32), twin[64:192])
    cut = q.narrow(1, 128, 256)
    assert torch.equal(dequantize(cut, torch.float32), twin[:, 128:384])


@pytest.mark.parametrize("name", [n for n in CT_FORMATS if not FORMATS[n].desc_act])
def test_compressed_tensors_layouts_are_the_librarys(name: str) -> None:
    """The test writer's compressed-tensors tensors decompress, by compressed-tensors itself
    (what vLLM and transformers load them with), into the twin's weights (rounded to the
    scales' bf16, the dtype the library dequantizes in). Its actorder group (weight_g_idx) is
    no longer in the library: that layout is checked against GPTQ's desc_act above."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    fmt = FORMATS[name]
    config = fmt.quantization_config()
    group = config["config_groups"]["group_0"]
    scheme = QuantizationScheme(
        targets=group["targets"],
        weights=group["weights"],
        input_activations=group["input_activations"],
    )
    parts, twin = _encode(fmt, _weight())
    out = BaseCompressor.load_from_registry(config["format"]).decompress(parts, scheme)
    assert torch.equal(out["weight"], twin.to(torch.bfloat16))


def test_a_dense_sparsity_config_loads() -> None:
    """llm-compressor records the sparsity it measured even where the weights are stored dense
    (`format: dense`), as in RedHatAI's quantized Qwen3 releases: nothing to refuse there."""
    sparsity = {"format": "dense", "global_sparsity": 0.14, "sparsity_structure": "unstructured"}
    config = QuantFormat("ct-pack").quantization_config() | {"sparsity_config": sparsity}
    scheme = parse_quantization_config(config)
    assert scheme is not None and scheme.method == "compressed-tensors" and scheme.bits == 4


def test_symmetric_zero_points_off_the_midpoint_are_refused() -> None:
    """An AutoRound sym export reads its zero points as the midpoint whichever way it stored
    them; zero points that are neither say the config is wrong: named, not loaded."""
    fmt = FORMATS["auto-round gptq 4 sym g128"]
    scheme = parse_quantization_config(fmt.quantization_config())
    assert scheme is not None and scheme.midpoint_zeros
    parts, _ = _encode(fmt, _weight())
    parts["qzeros"] = parts["qzeros"] ^ 1  # one zero point in eight moved off 7
    with pytest.raises(ValueError, match="qzeros: symmetric codes' zero points are all 8"):
        read_linear("model.layers.0.mlp.down_proj", parts, scheme)


def test_auto_round_extra_config_keeps_layers_in_16_bits() -> None:
    raw = QuantFormat("gptq", auto_round=True, not_converted=("model.layers.1.mlp.down_proj",))
    scheme = parse_quantization_config(raw.quantization_config())
    assert scheme is not None and "(from the checkpoint, auto-round)" in scheme.describe()
    assert scheme.for_module("model.layers.1.mlp.down_proj") is None
    assert scheme.for_module("model.layers.0.mlp.down_proj") is scheme


def test_a_compressed_tensors_groups_own_format_counts() -> None:
    """compressed-tensors writes each config group's format beside the top-level one, which
    says "mixed-precision" where groups differ: the group's is the one its tensors are in."""
    config = QuantFormat("ct-pack").quantization_config() | {"format": "mixed-precision"}
    config["config_groups"]["group_0"]["format"] = "pack-quantized"
    scheme = parse_quantization_config(config)
    assert scheme is not None and scheme.packed and scheme.bits == 4


def test_mixed_precision_configs_name_each_modules_format() -> None:
    """compressed-tensors' config_groups, GPTQModel's dynamic and AutoRound's extra_config:
    each module's format is the first pattern naming it, else the model's; "re:" patterns
    match from the name's start (an `ignore` list's too)."""
    down, attn = "model.layers.0.mlp.down_proj", "model.layers.0.self_attn.q_proj"
    w8 = QuantFormat("ct-int8", bits=8, group_size=-1)
    ct = QuantFormat("ct-pack", mixed=((r".*self_attn\.", w8),)).quantization_config()
    assert ct["format"] == "mixed-precision"
    scheme = parse_quantization_config(ct)
    assert scheme is not None and scheme.for_module(down) is scheme
    other = scheme.for_module(attn)
    assert other is not None and other.bits == 8 and not other.packed and other.group_size == 0
    assert scheme.describe().endswith("; 1 module pattern in compressed-tensors int-quantized "
                                      "8-bit, per channel, symmetric")  # fmt: skip
    # No group targets every Linear: what none targets is float.
    mlp = ((r".*self_attn\.", w8), (r".*mlp\.", QuantFormat("ct-pack")))
    ct = QuantFormat("ct-pack", mixed=mlp).quantization_config()
    del ct["config_groups"]["group_0"]
    only = parse_quantization_config(ct)
    assert only is not None and only.for_module("model.layers.0.mlp.router_proj") is not None
    assert only.for_module("model.layers.0.extra.out_proj") is None
    down_scheme, attn_scheme = only.for_module(down), only.for_module(attn)
    assert down_scheme is not None and down_scheme.bits == 4
    assert attn_scheme is not None and attn_scheme.bits == 8
    ignored = parse_quantization_config(
        QuantFormat("ct-pack", not_converted=("re:.*mlp[.]gate$",)).quantization_config()
    )
    assert ignored is not None and ignored.for_module("model.layers.3.mlp.gate") is None
    assert ignored.for_module("model.layers.3.mlp.gate_proj") is ignored
    # `ignore` wins over a group's targets, as in compressed-tensors.
    both = QuantFormat("ct-pack", not_converted=(attn,), mixed=((r".*self_attn\.", w8),))
    scheme = parse_quantization_config(both.quantization_config())
    assert scheme is not None and scheme.for_module(attn) is None
    gptq = QuantFormat("gptq").quantization_config() | {
        "dynamic": {r"-:.*layers\.1\.": {}, r"+:.*down_proj": {"bits": 8, "group_size": 64}}
    }
    scheme = parse_quantization_config(gptq)
    assert scheme is not None and scheme.for_module("model.layers.1.mlp.down_proj") is None
    eight = scheme.for_module(down)
    assert eight is not None and (eight.bits, eight.group_size) == (8, 64)


def test_awq_nibble_order_matters() -> None:
    """A reader that took AutoAWQ's nibbles in plain order would be wrong: the test can tell."""
    fmt = FORMATS["awq g128"]
    parts, twin = _encode(fmt, _weight())
    words = parts["qweight"]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    plain = ((words.unsqueeze(-1) >> shifts) & 15).flatten(1)  # [K, N], nibble order
    zeros = ((parts["qzeros"].unsqueeze(-1) >> shifts) & 15).flatten(1)
    wrong = (plain.float() - zeros.float().repeat_interleave(128, 0)) * parts[
        "scales"
    ].float().repeat_interleave(128, 0)
    assert not torch.equal(wrong.t(), twin)


def test_chunked_matmul_equals_the_dequantized_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    scheme = parse_quantization_config(FORMATS["gptq 4 asym g64"].quantization_config())
    assert scheme is not None
    parts, twin = _encode(FORMATS["gptq 4 asym g64"], _weight())
    q = read_linear("x", parts, scheme)
    # more rows than the quantized GEMV takes
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(0))
    whole = qlinear(x, q)
    monkeypatch.setattr(matmul, "CHUNK_ELEMENTS", K * 48)  # 6 row blocks, the last partial
    chunked = qlinear(x, q)
    # Against the exact products: fp32 sums of K terms in the kernel's order (another than
    # MKL's, whose result the default tolerance failed in ~1 of 5 random x) stay within 4e-5.
    exact = F.linear(x.double(), twin.double()).float()
    torch.testing.assert_close(whole, exact, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(chunked, whole)


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_quantize_at_load_stays_close(method: str) -> None:
    w = torch.from_numpy(_weight())
    q = quantize(w, load_scheme(method))
    err = (dequantize(q, torch.float32) - w).abs()
    per_row = w.abs().amax(dim=1, keepdim=True)
    # Half a step: int8 max/127/2, int4 (range/15)/2 <= max/15, fp8 e4m3 3 mantissa bits.
    bound = {"int8": per_row / 254, "int4": per_row / 15 + 1e-6, "fp8": w.abs() / 16 + 1e-3}
    assert bool((err <= bound[method] * 1.001).all())
    assert q.nbytes() <= N * K * (0.5 if method == "int4" else 1) * 1.1 + N * 4


@pytest.mark.parametrize(
    "config, says",
    [
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits=3"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version='gemv'"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"g": {"weights": {"type": "int", "num_bits": 2}}},
            },
            "format 'pack-quantized' with 2-bit int weights",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "nvfp4-pack-quantized",
                "config_groups": {"g": {"weights": {"type": "float", "num_bits": 4}}},
            },
            "format 'nvfp4-pack-quantized'",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {
                    "g": {"weights": {"type": "int", "num_bits": 4, "strategy": "block"}}
                },
            },
            "int weight strategy 'block'",
        ),
        ({"quant_method": "auto-round", "bits": 4, "data_type": "nv_fp"}, "data_type 'nv_fp'"),
        ({"quant_method": "auto-round", "bits": 2, "group_size": 128}, "bits=2"),
        (
            {"quant_method": "auto-round", "bits": 4, "packing_format": "auto_round:gptqmodel"},
            "packing_format 'auto_round:gptqmodel'",
        ),
        (
            {
                "quant_method": "auto-round",
                "bits": 4,
                "group_size": 128,
                "extra_config": {"model.layers.0.mlp.down_proj": {"bits": 3}},
            },
            "bits=3",
        ),
        (
            QuantFormat("ct-pack").quantization_config() | {"transform_config": {"u": {}}},
            "transform_config",
        ),
        (
            QuantFormat("ct-int8").quantization_config() | {"kv_cache_scheme": {"num_bits": 8}},
            "kv_cache_scheme",
        ),
        (
            QuantFormat("ct-pack").quantization_config()
            | {"sparsity_config": {"format": "sparse-24-bitmask"}},
            "sparsity format 'sparse-24-bitmask'",
        ),
    ],
)
def test_unsupported_quantization_fails_naming_what_is_supported(config, says) -> None:
    with pytest.raises(ValueError) as e:
        parse_quantization_config(config)
    assert says in str(e.value)
    assert "minisgl loads: fp8" in str(e.value) and "gptq (bits 4 or 8" in str(e.value)


def _headers(fmt: QuantFormat | None, extra: dict | None = None) -> dict:
    """Headers of a one-layer checkpoint: q_proj quantized in `fmt` (float when None)."""
    w = _weight()
    heads = {"model.embed_tokens.weight": ((1000, K), "F32")}
    if fmt is None:
        heads["model.layers.0.self_attn.q_proj.weight"] = ((N, K), "F32")
    else:
        parts, _ = _encode(fmt, w)
        dtypes = {
            torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32", torch.int32: "I32",
            torch.int8: "I8", torch.int64: "I64", torch.bfloat16: "BF16",
        }  # fmt: skip
        for k, v in parts.items():
            dt = dtypes.get(v.dtype, "F16")
            heads[f"model.layers.0.self_attn.q_proj.{k}"] = (tuple(v.shape), dt)
    return heads | (extra or {})


def test_an_extra_scale_tensor_is_named() -> None:
    fmt = FORMATS["fp8 block"]
    scheme = parse_quantization_config(fmt.quantization_config())
    stray = {"model.layers.0.self_attn.q_proj.weight_scale": ((2, 3), "F32")}
    with pytest.raises(ValueError, match=r"q_proj\.weight_scale is not used: the fp8 layout"):
        scan(_headers(fmt, stray), scheme)
    layout = scan(_headers(fmt), scheme)
    assert layout.shapes["model.layers.0.self_attn.q_proj.weight"] == (N, K)


def test_quantized_tensors_without_quantization_config_are_refused() -> None:
    with pytest.raises(ValueError, match="config.json has no quantization_config"):
        scan(_headers(FORMATS["fp8 block"]), None)
    with pytest.raises(ValueError, match="config.json has no quantization_config"):
        scan(_headers(FORMATS["awq g128"]), None)


def test_layout_problems_are_named() -> None:
    gptq = parse_quantization_config(FORMATS["gptq 4 asym g32 desc_act"].quantization_config())
    heads = _headers(FORMATS["gptq 4 asym g32 desc_act"])
    del heads["model.layers.0.self_attn.q_proj.g_idx"]
    with pytest.raises(ValueError, match=r"no tensor model.layers.0.self_attn.q_proj.g_idx"):
        scan(heads, gptq)
    head = {"lm_head.qweight": ((16, 1000), "I32"), "lm_head.scales": ((1, 1000), "F16")}
    with pytest.raises(ValueError, match="minisgl runs lm_head unquantized"):
        scan(_headers(None, head), gptq)
    skip = QuantFormat("awq", not_converted=("self_attn.q_proj",))
    with pytest.raises(ValueError, match="modules_to_not_convert"):
        scan(_headers(FORMATS["awq g128"]), parse_quantization_config(skip.quantization_config()))
    with pytest.raises(ValueError, match="already quantized"):
        scan(_headers(FORMATS["awq g128"]), load_scheme("int4"))
    # A module modules_to_not_convert keeps in float loads as a float weight.
    plain = scan(_headers(None), parse_quantization_config(skip.quantization_config()))
    assert plain.quantized == {}
