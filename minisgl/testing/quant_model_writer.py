"""A quantized checkpoint of a preset's shape written layer by layer: one safetensors shard per
decoder layer (plus one for the embedding and one for the final norm and LM head), so neither
the float model nor the quantized one is ever whole in memory. A Qwen3-30B-A3B shape in 4 bits
(~16 GB) is written by a process holding one layer (~0.3 GB).

Two sources of values:

- "quantized": the fixture's random float weights (fixture.py: the same values, seeded by
  tensor name) quantized one linear at a time by quant_writer's per-format functions; the
  checkpoint is tensor for tensor what `write_quantized_pair` makes from the float fixture.
- "codes": random codes drawn straight in the format's layout (uniform 4- or 8-bit codes,
  scales giving the preset's weight std, GPTQ/AWQ only). Quantizing 29 billion random floats
  takes hours on a small shared machine; for measuring memory and the load path the values do
  not matter, the layout does, and it is the same byte for byte.

    python -m minisgl.testing.quant_model_writer /tmp/a3b-gptq --preset 30b-a3b --format gptq
"""

from __future__ import annotations

import argparse
import hashlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from minisgl.testing.fixture import (
    _config,
    _generation_config,
    _RandomWeights,
    _tensor_specs,
    _write_json,
    write_tokenizer,
)
from minisgl.testing.presets import DTYPES, PRESETS, Preset
from minisgl.testing.quant_writer import LINEAR, QuantFormat, _awq, _fp8, _gptq, _input_of
from minisgl.testing.safetensors_writer import TensorSpec

SOURCES = ("quantized", "codes")
FORMATS = {
    "gptq": QuantFormat("gptq", bits=4, group_size=128, sym=True),  # Qwen's GPTQ-Int4 releases
    "gptq8": QuantFormat("gptq", bits=8, group_size=128, sym=True),
    "awq": QuantFormat("awq", bits=4, group_size=128),
    "fp8": QuantFormat("fp8"),
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
# Uniform codes 0..2^b-1 have this variance in units of scale^2: (4^b - 1) / 12.
_UNIFORM_VAR = {4: (16**2 - 1) / 12, 8: (256**2 - 1) / 12}


def _shard_key(name: str) -> int:
    """Which shard a tensor goes to: 0 the embedding, i + 1 decoder layer i, -1 the rest."""
    m = _LAYER.match(name)
    if m:
        return int(m.group(1)) + 1
    return 0 if name.startswith("model.embed_tokens.") else -1


def _values(source: _RandomWeights, spec: TensorSpec) -> np.ndarray:
    """The fixture's values of one tensor, in its dtype's bits (bf16 as uint16)."""
    return np.concatenate(list(source(spec))).reshape(spec.shape)


def _as_float32(raw: np.ndarray, tag: str) -> np.ndarray:
    """What `load_file(...)[name].float()` gives for the fixture's tensor."""
    if tag == "BF16":
        return (raw.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return raw.astype(np.float32)


def _as_torch(raw: np.ndarray, tag: str) -> torch.Tensor:
    if tag == "BF16":
        return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(raw)


def _random_codes(
    shape: tuple[int, int], fmt: QuantFormat, rng: np.random.Generator, std: float
) -> dict[str, np.ndarray]:
    """One linear [N, K] in fmt's layout with uniformly random codes: GPTQ `qweight` packed
    along K, AWQ along N (the nibble order does not matter for random codes); symmetric zero
    points at the midpoint; fp16 scales within 10% of the one giving weights of std `std`."""
    n, k = shape
    bits = fmt.bits
    g = fmt.group_size if fmt.group_size > 0 else k
    groups = -(-k // g)
    per = 32 // bits

    def words(rows: int, cols: int) -> np.ndarray:  # uniformly random int32 words
        raw = rng.bit_generator.random_raw(-(-rows * cols // 2))
        return raw.view(np.int32)[: rows * cols].reshape(rows, cols)

    base = std / np.sqrt(_UNIFORM_VAR[bits])
    if fmt.method == "awq":
        scales = (base * rng.uniform(0.9, 1.1, (groups, n))).astype(np.float16)
        return {"qweight": words(k, n // 8), "qzeros": words(groups, n // 8), "scales": scales}
    scales = (base * rng.uniform(0.9, 1.1, (groups, n))).astype(np.float16)
    if fmt.sym:
        mid = (1 << (bits - 1)) - (0 if fmt.gptq_v2 else 1)  # v1 stores zero points minus one
        word = 0
        for j in range(per):
            word |= mid << (j * bits)
        qzeros = np.full((groups, n // per), np.uint32(word).view(np.int32), dtype=np.int32)
    else:
        qzeros = words(groups, n // per)
    return {
        "qweight": words(k // per, n),
        "qzeros": qzeros,
        "scales": scales,
        "g_idx": (np.arange(k) // g).astype(np.int32),
    }


def _quantized(
    module: str, w: np.ndarray, fmt: QuantFormat, seed: int
) -> dict[str, np.ndarray | torch.Tensor]:
    if fmt.method == "awq":
        return _awq(w, fmt)[0]
    if fmt.method == "gptq":
        k = w.shape[1]
        order = np.arange(k)
        if fmt.desc_act:  # q/k/v (gate/up) read one input: one order for them, by its name
            key = hashlib.sha256(_input_of(module).encode()).digest()[:8]
            order = np.random.default_rng([seed, int.from_bytes(key, "little")]).permutation(k)
        return _gptq(w, fmt, order)[0]
    return _fp8(w, fmt)[0]


def _shard_tensors(
    specs: Sequence[TensorSpec],
    fmt: QuantFormat,
    source: str,
    values: _RandomWeights,
    std: float,
    seed: int,
) -> Iterator[tuple[str, torch.Tensor]]:
    for spec in specs:
        module = spec.name.rsplit(".", 1)[0]
        if not LINEAR.fullmatch(spec.name) or module in fmt.not_converted:
            yield spec.name, _as_torch(_values(values, spec), spec.dtype)
            continue
        parts: dict[str, np.ndarray | torch.Tensor]
        if source == "codes":
            key = hashlib.sha256(spec.name.encode()).digest()[:8]
            rng = np.random.default_rng([seed, int.from_bytes(key, "little")])
            n, k = spec.shape
            parts = dict(_random_codes((n, k), fmt, rng, std))
        else:
            w = _as_float32(_values(values, spec), spec.dtype)
            parts = _quantized(module, w, fmt, seed)
        for suffix, v in parts.items():
            t = v if isinstance(v, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(v))
            yield f"{module}.{suffix}", t


def write_quantized_model(
    out_dir: str | Path,
    preset: str,
    fmt: QuantFormat,
    *,
    source: str = "quantized",
    tie_word_embeddings: bool = False,
    dtype: str | None = None,
    seed: int = 0,
    std: float | None = None,
    num_hidden_layers: int | None = None,
    progress: bool = False,
) -> Path:
    """Write `preset` (its depth cut to num_hidden_layers if given) as a checkpoint in `fmt`,
    one shard per decoder layer, with config.json's quantization_config and the tokenizer."""
    from safetensors.torch import save_file

    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; choose from {', '.join(SOURCES)}")
    if source == "codes" and fmt.method not in ("gptq", "awq"):
        raise ValueError("random codes are written for gptq and awq only")
    if source == "codes" and fmt.desc_act:
        raise ValueError("random codes are written without desc_act")
    p: Preset = PRESETS[preset]
    if num_hidden_layers is not None:
        p = replace(p, num_hidden_layers=num_hidden_layers)
    dtype = dtype or p.dtype
    std = p.std if std is None else std
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)

    specs = _tensor_specs(p, tie_word_embeddings, DTYPES[dtype])
    shards: dict[int, list[TensorSpec]] = {}
    for spec in specs:
        shards.setdefault(_shard_key(spec.name), []).append(spec)
    order = sorted(shards, key=lambda key: key if key >= 0 else len(shards) + 1)
    values = _RandomWeights(seed, std)
    weight_map: dict[str, str] = {}
    total = 0
    for i, key in enumerate(order):
        name = f"model-{i + 1:05d}-of-{len(order):05d}.safetensors"
        tensors = dict(_shard_tensors(shards[key], fmt, source, values, std, seed))
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map |= dict.fromkeys(tensors, name)
        del tensors
        if progress:
            print(f"wrote {name} ({total / 2**30:.2f} GiB so far)", flush=True)
    _write_json(
        out / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )
    config = _config(p, tie_word_embeddings, dtype)
    config["quantization_config"] = fmt.quantization_config()
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", _generation_config())
    write_tokenizer(out)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m minisgl.testing.quant_model_writer",
        description="Write a random quantized checkpoint of a preset's shape, layer by layer.",
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quant")
    parser.add_argument("--format", choices=sorted(FORMATS), default="gptq")
    parser.add_argument("--source", choices=SOURCES, default="quantized")
    parser.add_argument("--num-layers", type=int, default=None, help="preset default")
    parser.add_argument("--tied", action="store_true", help="tie the LM head to the embedding")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = write_quantized_model(
        args.out_dir,
        args.preset,
        FORMATS[args.format],
        source=args.source,
        tie_word_embeddings=args.tied,
        seed=args.seed,
        num_hidden_layers=args.num_layers,
        progress=True,
    )
    print(out)


if __name__ == "__main__":
    main()
