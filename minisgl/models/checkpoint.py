"""Does a checkpoint's set of tensors fit its config.json? Told in config.json's terms.

The loader reads only the tensors' names and shapes (safetensors headers) and asks this module
before it builds the model: "config.json declares 16 experts per layer (num_experts /
num_local_experts) ... but the checkpoint has a dense MLP there" says what to fix where a bare
"no tensor model.layers.0.mlp.experts.0..." or a failed copy would not. Torch-free.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from minisgl.models.config import ModelConfig
from minisgl.models.registry import has_experts

EXPERTS = "num_experts / num_local_experts"  # the two spellings of the count in config.json
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)")
Shapes = Mapping[str, tuple[int, ...]]


class AttentionFlags(Protocol):
    """What a family's attention has beyond plain GQA (qwen3.AttentionOptions)."""

    qk_norm: bool
    qkv_bias: bool
    o_bias: bool


@dataclass(frozen=True)
class Expected:
    shape: tuple[int, ...]
    why: str  # the config.json values the shape follows from


def expected_tensors(config: ModelConfig, attn: AttentionFlags) -> dict[str, Expected]:
    """Every tensor the model reads, by its Hugging Face name, with its full (unsharded)
    shape."""
    c = config
    h, d = c.hidden_size, c.head_dim
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    hid = f"hidden_size={h}"
    q_why = f"num_attention_heads={c.num_attention_heads} x head_dim={d}"
    kv_why = f"num_key_value_heads={c.num_key_value_heads} x head_dim={d}"
    embed = Expected((c.vocab_size, h), f"vocab_size={c.vocab_size}, {hid}")
    out = {"model.embed_tokens.weight": embed}
    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        layer = {
            "self_attn.q_proj.weight": Expected((q, h), f"{q_why}, {hid}"),
            "self_attn.k_proj.weight": Expected((kv, h), f"{kv_why}, {hid}"),
            "self_attn.v_proj.weight": Expected((kv, h), f"{kv_why}, {hid}"),
            "self_attn.o_proj.weight": Expected((h, q), f"{hid}, {q_why}"),
        }
        if attn.qk_norm:
            layer["self_attn.q_norm.weight"] = Expected((d,), f"head_dim={d}")
            layer["self_attn.k_norm.weight"] = Expected((d,), f"head_dim={d}")
        if attn.qkv_bias:
            layer["self_attn.q_proj.bias"] = Expected((q,), q_why)
            layer["self_attn.k_proj.bias"] = Expected((kv,), kv_why)
            layer["self_attn.v_proj.bias"] = Expected((kv,), kv_why)
        if attn.o_bias:
            layer["self_attn.o_proj.bias"] = Expected((h,), hid)
        layer |= _mlp(c, i)
        layer["input_layernorm.weight"] = Expected((h,), hid)
        layer["post_attention_layernorm.weight"] = Expected((h,), hid)
        out |= {pre + k: v for k, v in layer.items()}
    out["model.norm.weight"] = Expected((h,), hid)
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = embed
    return out


def _mlp(c: ModelConfig, i: int) -> dict[str, Expected]:
    h = c.hidden_size
    if not c.is_moe_layer(i):
        why = f"intermediate_size={c.intermediate_size}, hidden_size={h}"
        up = Expected((c.intermediate_size, h), why)
        return {
            "mlp.gate_proj.weight": up,
            "mlp.up_proj.weight": up,
            "mlp.down_proj.weight": Expected((h, c.intermediate_size), why),
        }
    why = f"moe_intermediate_size={c.moe_intermediate_size}, hidden_size={h}"
    up = Expected((c.moe_intermediate_size, h), why)
    down = Expected((h, c.moe_intermediate_size), why)
    router = Expected((c.num_experts, h), f"{EXPERTS}={c.num_experts}, hidden_size={h}")
    out = {"mlp.gate.weight": router}
    for e in range(c.num_experts):
        out |= {
            f"mlp.experts.{e}.gate_proj.weight": up,
            f"mlp.experts.{e}.up_proj.weight": up,
            f"mlp.experts.{e}.down_proj.weight": down,
        }
    return out


def mismatches(config: ModelConfig, attn: AttentionFlags, shapes: Shapes) -> list[str]:
    """What in the checkpoint (tensor name -> shape) does not fit config.json: one line per
    kind of problem, told for its first layer and naming the other layers it is in; empty when
    the checkpoint fits."""
    found = _Findings()
    n = config.num_hidden_layers
    present = _layers(shapes)
    absent = [i for i in range(n) if i not in present]
    if absent:
        found.add(
            ("layers",),
            None,
            f"config.json declares num_hidden_layers={n}, but the checkpoint has no tensors for "
            f"layer {absent[0]} (model.layers.{absent[0]}.*): it has {len(present)} layers",
        )
    mlp_told: set[int] = set()
    for name, want in expected_tensors(config, attn).items():
        m = _LAYER.fullmatch(name)
        layer = int(m.group(1)) if m else None
        rest = m.group(2) if m else name
        if layer in absent:
            continue  # said once above
        if name in shapes:
            got = tuple(shapes[name])
            if got != want.shape:
                found.add(("shape", rest), layer, _shape_problem(name, got, want, shapes))
        elif layer is not None and rest.startswith("mlp."):
            if layer not in mlp_told:  # one line per layer's MLP, not one per expert
                mlp_told.add(layer)
                kind, line = _mlp_problem(config, layer, name, shapes)
                found.add(("mlp", kind), layer, line)
        else:
            found.add(("missing", rest), layer, _missing_problem(config, name))
    return found.lines()


def surplus_layers(config: ModelConfig, shapes: Shapes) -> str | None:
    """A note when the checkpoint has layers beyond config.json's num_hidden_layers. Not an
    error: lowering num_hidden_layers is how people cut a model down for a quick test, and
    transformers runs such a checkpoint too (it warns of the unused tensors)."""
    n = config.num_hidden_layers
    beyond = sorted(i for i in _layers(shapes) if i >= n)
    if not beyond:
        return None
    first, last = beyond[0], beyond[-1]
    unused = (
        f"layer {first} (model.layers.{first}.*) is"
        if first == last
        else f"layers {first}..{last} (model.layers.{first}.* to model.layers.{last}.*) are"
    )
    return f"config.json declares num_hidden_layers={n}; the checkpoint's {unused} not used"


def _layers(shapes: Shapes) -> set[int]:
    return {int(m.group(1)) for m in map(_LAYER.fullmatch, shapes) if m}


class _Findings:
    """Problems by kind, in the order first seen, with the layers each one is in."""

    def __init__(self) -> None:
        self._line: dict[tuple[str, ...], str] = {}
        self._layers: dict[tuple[str, ...], list[int]] = {}

    def add(self, key: tuple[str, ...], layer: int | None, line: str) -> None:
        if key not in self._line:
            self._line[key] = line
            self._layers[key] = []
        if layer is not None and layer not in self._layers[key]:
            self._layers[key].append(layer)

    def lines(self) -> list[str]:
        out = []
        for key, line in self._line.items():
            others = self._layers[key][1:]
            if others:
                line += f" (the same in layer{'s' if len(others) > 1 else ''} "
                line += ", ".join(map(str, others)) + ")"
            out.append(line)
        return out


def _shape_problem(name: str, got: tuple[int, ...], want: Expected, shapes: Shapes) -> str:
    line = (
        f"{name} is {list(got)} in the checkpoint, but config.json implies "
        f"{list(want.shape)} ({want.why})"
    )
    m = _LAYER.fullmatch(name)
    if m and m.group(2) == "mlp.gate.weight":  # the router: one row per expert
        count = len(_experts(shapes, int(m.group(1))))
        line += f"; layer {m.group(1)} of the checkpoint has {count} experts"
    return line


def _experts(shapes: Shapes, layer: int) -> list[str]:
    pre = f"model.layers.{layer}.mlp.experts."
    return sorted({k[len(pre) :].split(".")[0] for k in shapes if k.startswith(pre)})


def _mlp_problem(c: ModelConfig, layer: int, name: str, shapes: Shapes) -> tuple[str, str]:
    """(kind, line) for the first tensor of layer `layer`'s MLP the checkpoint lacks."""
    pre = f"model.layers.{layer}.mlp."
    experts = _experts(shapes, layer)
    if c.is_moe_layer(layer):
        declared = (
            f"config.json declares {c.num_experts} experts per layer ({EXPERTS}) "
            f"and layer {layer} sparse"
        )
        if pre + "gate_proj.weight" in shapes and not experts:
            return "dense there", (
                f"{declared}, but the checkpoint has a dense MLP there ({pre}gate_proj.weight) "
                f"and no {pre}experts.0.gate_proj.weight"
            )
        if experts and len(experts) < c.num_experts:
            return "fewer experts", (
                f"{declared}, but layer {layer} of the checkpoint has {len(experts)} experts "
                f"(no tensor {name})"
            )
        return "sparse, missing", f"{declared}, but the checkpoint has no tensor {name}"
    if not has_experts(c.architecture):
        reason = f"{c.architecture} has no experts"
    elif c.num_experts == 0:
        reason = f"{EXPERTS} is 0"
    elif layer in c.mlp_only_layers:
        reason = f"mlp_only_layers={list(c.mlp_only_layers)}"
    else:
        reason = f"decoder_sparse_step={c.decoder_sparse_step}"
    if experts:
        return "experts there", (
            f"config.json declares layer {layer} dense ({reason}), but the checkpoint has "
            f"experts there ({pre}experts.{experts[0]}.gate_proj.weight) and no tensor {name}"
        )
    return "dense, missing", (
        f"config.json declares layer {layer} dense ({reason}), but the checkpoint has no "
        f"tensor {name}"
    )


def _missing_problem(c: ModelConfig, name: str) -> str:
    if name == "lm_head.weight":
        return (
            "config.json declares tie_word_embeddings=false, but the checkpoint has no tensor "
            "lm_head.weight"
        )
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return (
            f"{c.architecture} (config.json's architectures) normalises q and k per head, but "
            f"the checkpoint has no tensor {name}"
        )
    if name.endswith(".bias"):
        cause = (
            "config.json declares attention_bias=true"
            if c.attention_bias
            else f"{c.architecture} (config.json's architectures) has q/k/v biases"
        )
        return f"{cause}, but the checkpoint has no tensor {name}"
    return f"the checkpoint has no tensor {name}, which config.json's {c.architecture} needs"
