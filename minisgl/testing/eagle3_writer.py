"""Write a random EAGLE-3 draft head for a target checkpoint, in the layout SpecForge saves
and SGLang loads (config.json with `architectures: ["LlamaForCausalLMEagle3"]`, one
model.safetensors), so speculative decoding with eagle3 runs offline.

    python -m minisgl.testing.eagle3_writer /tmp/head --target /tmp/qwen3-tiny

The draft vocabulary is a seeded random subset of the target's ids (sorted), with the real
`d2t` offsets and `t2d` mask; weights come from numpy like the target fixture's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from minisgl.testing.fixture import _RandomWeights
from minisgl.testing.presets import DTYPES
from minisgl.testing.safetensors_writer import TensorSpec, write_safetensors


def head_tensor_specs(
    target: dict[str, Any], draft_vocab: int, tag: str, with_embedding: bool
) -> list[TensorSpec]:
    """The published head's tensors for a target config.json (head as wide as the target)."""
    h, vocab = int(target["hidden_size"]), int(target["vocab_size"])
    heads, kv_heads = int(target["num_attention_heads"]), int(target["num_key_value_heads"])
    d = int(target.get("head_dim") or h // heads)
    inter = int(target["intermediate_size"])
    m = "midlayer."
    shapes: list[tuple[str, tuple[int, ...], str]] = [
        ("fc.weight", (h, 3 * h), tag),
        (m + "self_attn.q_proj.weight", (heads * d, 2 * h), tag),
        (m + "self_attn.k_proj.weight", (kv_heads * d, 2 * h), tag),
        (m + "self_attn.v_proj.weight", (kv_heads * d, 2 * h), tag),
        (m + "self_attn.o_proj.weight", (h, heads * d), tag),
        (m + "mlp.gate_proj.weight", (inter, h), tag),
        (m + "mlp.up_proj.weight", (inter, h), tag),
        (m + "mlp.down_proj.weight", (h, inter), tag),
        (m + "input_layernorm.weight", (h,), tag),
        (m + "hidden_norm.weight", (h,), tag),
        (m + "post_attention_layernorm.weight", (h,), tag),
        ("norm.weight", (h,), tag),
        ("lm_head.weight", (draft_vocab, h), tag),
        ("d2t", (draft_vocab,), "I64"),
        ("t2d", (vocab,), "BOOL"),
    ]
    if with_embedding:
        shapes.insert(0, ("embed_tokens.weight", (vocab, h), tag))
    return [TensorSpec(name, shape, t) for name, shape, t in shapes]


def draft_vocabulary(vocab: int, draft_vocab: int, seed: int) -> np.ndarray:
    """The target ids the draft vocabulary covers: a seeded sorted subset."""
    rng = np.random.default_rng([seed, 0xD2])
    return np.sort(rng.choice(vocab, size=draft_vocab, replace=False)).astype(np.int64)


class _HeadWeights:
    def __init__(self, seed: int, std: float, ids: np.ndarray, vocab: int) -> None:
        self.random = _RandomWeights(seed, std)
        self.ids, self.vocab = ids, vocab

    def __call__(self, spec: TensorSpec) -> Iterator[np.ndarray]:
        if spec.name == "d2t":  # draft id i is target id i + d2t[i]
            yield (self.ids - np.arange(len(self.ids))).astype("<i8")
        elif spec.name == "t2d":
            mask = np.zeros(self.vocab, dtype=np.uint8)
            mask[self.ids] = 1
            yield mask
        else:
            yield from self.random(spec)


def write_eagle3_head(
    out_dir: str | Path,
    target_dir: str | Path,
    *,
    draft_vocab_size: int = 4096,
    aux_layer_ids: Sequence[int] | None = None,
    with_embedding: bool = False,
    seed: int = 0,
    std: float = 0.5,
    extra_tensors: Sequence[str] = (),
    drop_tensors: Sequence[str] = (),
) -> Path:
    """A random head for the target at `target_dir` (its hidden size, heads, dtype, vocab).

    aux_layer_ids goes to eagle_config (None: left out, the target's depth picks the default);
    without the embedding the head shares the target's. extra_tensors / drop_tensors write a
    broken checkpoint (tests of the loader's refusals). Returns the directory."""
    target = json.loads((Path(target_dir) / "config.json").read_text())
    vocab = int(target["vocab_size"])
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size must be in 1..{vocab}, got {draft_vocab_size}")
    dtype = str(target.get("torch_dtype") or target.get("dtype") or "float32")
    tag = DTYPES[dtype]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specs = [
        s
        for s in head_tensor_specs(target, draft_vocab_size, tag, with_embedding)
        if s.name not in drop_tensors
    ]
    specs += [TensorSpec(name, (4,), tag) for name in extra_tensors]
    ids = draft_vocabulary(vocab, draft_vocab_size, seed)
    # A different seed per head than the target's weights with the same names would get.
    head_seed = int.from_bytes(hashlib.sha256(f"eagle3-{seed}".encode()).digest()[:4], "little")
    write_safetensors(out / "model.safetensors", specs, _HeadWeights(head_seed, std, ids, vocab))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": target["hidden_size"],
        "intermediate_size": target["intermediate_size"],
        "num_attention_heads": target["num_attention_heads"],
        "num_key_value_heads": target["num_key_value_heads"],
        "head_dim": target.get("head_dim")
        or target["hidden_size"] // target["num_attention_heads"],
        "num_hidden_layers": 1,
        "max_position_embeddings": target.get("max_position_embeddings", 4096),
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "rope_theta": target.get("rope_theta", 1_000_000.0),
        "rope_scaling": target.get("rope_scaling"),
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab_size,
    }
    if aux_layer_ids is not None:
        config["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
            "use_aux_hidden_state": True,
        }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m minisgl.testing.eagle3_writer",
        description="Write a random EAGLE-3 head (SpecForge/SGLang layout) for a target.",
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--target", type=Path, required=True, help="the target's directory")
    parser.add_argument("--draft-vocab-size", type=int, default=4096)
    parser.add_argument("--aux-layers", type=int, nargs=3, default=None)
    parser.add_argument("--with-embedding", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(
        write_eagle3_head(
            args.out_dir,
            args.target,
            draft_vocab_size=args.draft_vocab_size,
            aux_layer_ids=args.aux_layers,
            with_embedding=args.with_embedding,
            seed=args.seed,
        )
    )


if __name__ == "__main__":
    main()
