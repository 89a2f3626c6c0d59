"""Write a random Qwen3 checkpoint with Qwen's real tokenizer, so everything runs offline.

The directory looks like a Hugging Face Qwen3 snapshot (config.json, generation_config.json,
safetensors weights with HF tensor names, tokenizer files, chat template): transformers'
AutoModelForCausalLM/AutoTokenizer and our own loader both read it. Presets of the other
architectures (Qwen3-MoE, Qwen2, Llama) write their own config and tensor names with the same
Qwen tokenizer (a random model does not care whose vocabulary it has).

    python -m minisgl.testing.fixture /tmp/qwen3-tiny [--preset tiny|0.6b|qwen3-moe|...]
    python -m minisgl.testing.fixture /tmp/a3b --preset 30b-a3b --num-layers 4
    python -m minisgl.testing.fixture /tmp/moe --preset qwen3-moe --writer transformers

The last has the installed transformers build the model and `save_pretrained` it, so its
config.json keys are whatever that release writes (transformers_writer.py).

Weights come from numpy (no torch import) with one generator per tensor seeded by the tensor's
name, so the values do not depend on sharding or write order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import replace
from importlib import resources
from math import prod
from pathlib import Path
from typing import Any

import numpy as np

from minisgl.testing.presets import (
    ARCHS,
    BOS_ID,
    DTYPES,
    EOS_ID,
    NORM_NOISE,
    PRESETS,
    VOCAB_SIZE,
    Preset,
)
from minisgl.testing.safetensors_writer import TensorSpec, write_safetensors
from minisgl.testing.tokenizer_builder import (
    QWEN3_ADDED_TOKENS,
    added_token_id,
    qwen3_tokenizer_json,
)

CHUNK_ELEMENTS = 1 << 22  # bounds peak memory while generating the large tensors
WRITERS = ("minisgl", "transformers")


def _is_moe_layer(p: Preset, i: int) -> bool:
    return p.num_experts > 0 and i not in p.mlp_only_layers


def _config(p: Preset, tied: bool, dtype: str) -> dict[str, Any]:
    arch, model_type = ARCHS[p.arch]
    extra: dict[str, Any] = {}
    if p.arch == "qwen3_moe":
        extra = {
            "num_experts": p.num_experts,
            "num_experts_per_tok": p.num_experts_per_tok,
            "moe_intermediate_size": p.moe_intermediate_size,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(p.mlp_only_layers),
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        }
    return extra | {
        "architectures": [arch],
        "model_type": model_type,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "hidden_size": p.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": p.intermediate_size,
        "max_position_embeddings": p.max_position_embeddings,
        "max_window_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_hidden_layers": p.num_hidden_layers,
        "num_key_value_heads": p.num_key_value_heads,
        "rms_norm_eps": 1e-6,
        "rope_scaling": p.rope_scaling,
        "rope_theta": p.rope_theta,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": tied,
        # Qwen3 ships torch_dtype; transformers >= 4.56 writes dtype. Readers check either.
        "torch_dtype": dtype,
        "dtype": dtype,
        "use_cache": True,
        "vocab_size": VOCAB_SIZE,
    }


def _generation_config() -> dict[str, Any]:
    # Qwen3 lists both ids. Its sampling defaults (do_sample, temperature 0.6, ...) are left
    # out: a random model gains nothing from them and greedy tests stay greedy by default.
    return {
        "bos_token_id": BOS_ID,
        "eos_token_id": [EOS_ID, BOS_ID],
        "pad_token_id": BOS_ID,
    }


def _tensor_specs(p: Preset, tied: bool, tag: str) -> list[TensorSpec]:
    h, q, kv = p.hidden_size, p.num_attention_heads * p.head_dim, p.num_key_value_heads * p.head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB_SIZE, h))]
    for i in range(p.num_hidden_layers):
        pre = f"model.layers.{i}."
        shapes += [
            (pre + "self_attn.q_proj.weight", (q, h)),
            (pre + "self_attn.k_proj.weight", (kv, h)),
            (pre + "self_attn.v_proj.weight", (kv, h)),
            (pre + "self_attn.o_proj.weight", (h, q)),
        ]
        if p.arch in ("qwen3", "qwen3_moe"):
            shapes += [
                (pre + "self_attn.q_norm.weight", (p.head_dim,)),
                (pre + "self_attn.k_norm.weight", (p.head_dim,)),
            ]
        if p.arch == "qwen2":
            shapes += [
                (pre + "self_attn.q_proj.bias", (q,)),
                (pre + "self_attn.k_proj.bias", (kv,)),
                (pre + "self_attn.v_proj.bias", (kv,)),
            ]
        shapes += _mlp_shapes(p, i)
        shapes += [
            (pre + "input_layernorm.weight", (h,)),
            (pre + "post_attention_layernorm.weight", (h,)),
        ]
    shapes.append(("model.norm.weight", (h,)))
    if not tied:
        shapes.append(("lm_head.weight", (VOCAB_SIZE, h)))
    return [TensorSpec(name, shape, tag) for name, shape in shapes]


def _mlp_shapes(p: Preset, i: int) -> list[tuple[str, tuple[int, ...]]]:
    pre, h = f"model.layers.{i}.mlp.", p.hidden_size
    if not _is_moe_layer(p, i):
        inter = p.intermediate_size
        return [
            (pre + "gate_proj.weight", (inter, h)),
            (pre + "up_proj.weight", (inter, h)),
            (pre + "down_proj.weight", (h, inter)),
        ]
    inter = p.moe_intermediate_size
    shapes: list[tuple[str, tuple[int, ...]]] = [(pre + "gate.weight", (p.num_experts, h))]
    for e in range(p.num_experts):
        shapes += [
            (f"{pre}experts.{e}.gate_proj.weight", (inter, h)),
            (f"{pre}experts.{e}.up_proj.weight", (inter, h)),
            (f"{pre}experts.{e}.down_proj.weight", (h, inter)),
        ]
    return shapes


def _to_dtype(values: np.ndarray, tag: str) -> np.ndarray:
    if tag == "F32":
        return values.astype("<f4", copy=False)
    if tag == "F16":
        return values.astype("<f2")
    # bfloat16 = top half of float32, rounded to nearest even (numpy has no bf16 type).
    bits = values.astype("<f4", copy=False).view("<u4")
    rounded = bits + (((bits >> 16) & 1) + 0x7FFF).astype("<u4")
    return (rounded >> 16).astype("<u2")


class _RandomWeights:
    def __init__(self, seed: int, std: float) -> None:
        self.seed, self.std = seed, std

    def __call__(self, spec: TensorSpec) -> Iterator[np.ndarray]:
        name_key = int.from_bytes(hashlib.sha256(spec.name.encode()).digest()[:8], "little")
        rng = np.random.default_rng([self.seed, name_key])
        is_norm = spec.name.endswith("norm.weight")
        remaining = prod(spec.shape)
        while remaining:
            n = min(remaining, CHUNK_ELEMENTS)
            values = rng.standard_normal(n, dtype=np.float32)
            if is_norm:
                values = 1.0 + NORM_NOISE * values
            else:
                values *= self.std
            yield _to_dtype(values, spec.dtype)
            remaining -= n


def _split_shards(specs: Sequence[TensorSpec], num_shards: int) -> list[list[TensorSpec]]:
    """Contiguous groups of roughly equal bytes, none empty."""
    if not 1 <= num_shards <= len(specs):
        raise ValueError(f"num_shards must be in 1..{len(specs)}, got {num_shards}")
    total = sum(s.nbytes for s in specs)
    shards: list[list[TensorSpec]] = [[]]
    done = 0
    for i, spec in enumerate(specs):
        shards_left = num_shards - len(shards)
        must_split = len(specs) - i == shards_left
        full = done >= total * len(shards) / num_shards
        if shards[-1] and shards_left > 0 and (full or must_split):
            shards.append([])
        shards[-1].append(spec)
        done += spec.nbytes
    return shards


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def chat_template() -> str:
    return resources.files("minisgl.testing").joinpath("chat_template.jinja").read_text("utf-8")


def write_tokenizer(out_dir: Path, model_max_length: int = 131072) -> None:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja, as Qwen3 ships them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_bytes(qwen3_tokenizer_json())
    template = chat_template()
    (out_dir / "chat_template.jinja").write_text(template, encoding="utf-8")
    first = added_token_id(QWEN3_ADDED_TOKENS[0].content)
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "Qwen2Tokenizer",
            "add_bos_token": False,
            "add_prefix_space": False,
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "errors": "replace",
            "clean_up_tokenization_spaces": False,
            "split_special_tokens": False,
            "model_max_length": model_max_length,
            "added_tokens_decoder": {
                str(first + i): {
                    "content": t.content,
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": t.special,
                }
                for i, t in enumerate(QWEN3_ADDED_TOKENS)
            },
            "additional_special_tokens": [t.content for t in QWEN3_ADDED_TOKENS[1:14]],
            # Older transformers read the template from here; newer ones prefer the .jinja file.
            "chat_template": template,
        },
    )


def write_fixture_model(
    out_dir: str | Path,
    preset: str = "tiny",
    *,
    tie_word_embeddings: bool = True,
    dtype: str | None = None,
    seed: int = 0,
    std: float | None = None,
    num_shards: int = 1,
    progress: bool | None = None,
    num_hidden_layers: int | None = None,
    writer: str = "minisgl",
) -> Path:
    """Write a random Qwen3 checkpoint plus the real Qwen3 tokenizer into `out_dir`.

    dtype and std default to the preset's (tiny: float32, std 0.5; 0.6b: bfloat16, std 0.02).
    progress defaults to a bar for checkpoints over 100 MB. num_hidden_layers overrides the
    preset's (a 30B-A3B shape with a few layers fits a benchmark machine). writer "minisgl"
    streams the tensors from here, with config.json spelt as the hub's checkpoints are;
    "transformers" has the installed transformers build the model and `save_pretrained` it
    (its own key names, one shard, its own initialisation). Returns the directory.
    """
    if writer not in WRITERS:
        raise ValueError(f"unknown writer {writer!r}; choose from {', '.join(WRITERS)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    p = PRESETS[preset]
    if num_hidden_layers is not None:
        p = replace(p, num_hidden_layers=num_hidden_layers)
    dtype = dtype or p.dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose from {sorted(DTYPES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Weights left by an earlier write with another shard count would confuse loaders.
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    if writer == "transformers":
        if num_shards != 1:
            raise ValueError("the transformers writer writes one shard")
        from minisgl.testing.transformers_writer import save_random_model

        save_random_model(out, p, tie_word_embeddings, dtype, seed, p.std if std is None else std)
        write_tokenizer(out)
        return out

    specs = _tensor_specs(p, tie_word_embeddings, DTYPES[dtype])
    shards = _split_shards(specs, num_shards)
    total = sum(s.nbytes for s in specs)
    source = _RandomWeights(seed, p.std if std is None else std)
    names = (
        ["model.safetensors"]
        if num_shards == 1
        else [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    )

    show = total > 100 * 2**20 if progress is None else progress
    bar = None
    if show:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {preset} weights")
    try:
        for name, group in zip(names, shards, strict=True):
            write_safetensors(out / name, group, source, bar.update if bar else None)
    finally:
        if bar is not None:
            bar.close()
    if num_shards > 1:
        weight_map = {s.name: n for n, group in zip(names, shards, strict=True) for s in group}
        _write_json(
            out / "model.safetensors.index.json",
            {"metadata": {"total_size": total}, "weight_map": weight_map},
        )

    _write_json(out / "config.json", _config(p, tie_word_embeddings, dtype))
    _write_json(out / "generation_config.json", _generation_config())
    write_tokenizer(out)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m minisgl.testing.fixture",
        description="Write a random Qwen3 checkpoint with Qwen's real tokenizer (offline).",
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="preset default")
    parser.add_argument("--untied", action="store_true", help="separate lm_head weights")
    parser.add_argument("--num-shards", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-layers", type=int, default=None, help="preset default")
    parser.add_argument("--std", type=float, default=None, help="preset default")
    parser.add_argument(
        "--writer",
        choices=WRITERS,
        default="minisgl",
        help="transformers: the installed transformers' save_pretrained writes it",
    )
    args = parser.parse_args(argv)
    out = write_fixture_model(
        args.out_dir,
        args.preset,
        tie_word_embeddings=not args.untied,
        dtype=args.dtype,
        seed=args.seed,
        std=args.std,
        num_shards=args.num_shards,
        num_hidden_layers=args.num_layers,
        writer=args.writer,
    )
    print(out)


if __name__ == "__main__":
    main()
