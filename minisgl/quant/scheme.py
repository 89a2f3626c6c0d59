"""Which quantization a model runs with: read from config.json's `quantization_config`, or asked
for with `--quantization` on a float checkpoint. Torch-free (models/config.py imports it).

Every scheme is told by the same few facts: the bits of a weight code, the group of input
features one scale (and zero point) covers, whether there are zero points, and where it comes
from. Anything not in SUPPORTED fails here, at start, naming what is supported.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from minisgl.config import LM_HEAD_QUANTIZATIONS
from minisgl.config import QUANTIZATIONS as LOAD_METHODS  # --quantization's choices

SUPPORTED = (
    "fp8 (quant_method fp8, fmt e4m3, weight_block_size [128, 128] or none: per tensor)",
    "compressed-tensors FP8 (float 8-bit weights, strategy tensor, channel or block; dynamic "
    "or no activation quantization)",
    "compressed-tensors integer weights (format pack-quantized: 4 or 8 bits; int-quantized or "
    "naive-quantized: 8 bits; strategy group, channel or tensor, symmetric or with zero "
    "points, actorder group, weight or none; no or dynamic activation quantization); "
    "config_groups mixing these formats, one targeting Linear or the rest in float",
    "awq (bits 4, zero_point true, version gemm, any group_size dividing the input features)",
    "gptq (bits 4 or 8, sym true or false, group_size 32/64/128/... or -1, desc_act true or "
    "false, checkpoint_format gptq or gptq_v2, GPTQModel's dynamic per-module overrides)",
    "auto-round (Intel's AutoRound: data_type int, packing_format auto_round:auto_gptq with "
    "bits 4 or 8, or auto_round:auto_awq with bits 4; extra_config per layer)",
    "GGUF files (--model path/to/model.gguf or <owner>/<repo>:<type>; Q8_0, Q4_0, Q4_1, Q5_0, "
    "Q5_1, IQ4_NL, IQ4_XS, Q4_K and Q5_K projections held as they are, Q6_K, Q3_K and Q2_K ones "
    "on the CPU (untied tables in them everywhere), other types dequantized at load)",
)
# GGUF types held as they are -> the bits a weight they store; models/gguf.py writes the config
# naming them. Blocks of 32 weights of a row with a float16 scale d: Q8_0 / Q4_0 / Q5_0 (codes
# q, weight = (q - zero) * d), Q4_1 / Q5_1 (and a float16 m: weight = d * q + m), IQ4_NL (4-bit
# indices into a table of 16 int8 values, GGUF_LOOKUP_TYPES: weight = d * table[q]). Super-blocks
# of 256: the K-quants with mins (GGUF_K_TYPES), each group of 32 with a 6-bit scale and a 6-bit
# min under the super-block's float16 d and dmin (weight = d * sc * q - dmin * m); IQ4_XS, IQ4_NL's
# values with a 6-bit scale per 32 under d. 4-bit codes are held as 4-bit codes, the others (and
# the table's values) as 8-bit ones, a scale (and a min: GGUF_MIN_TYPES) per 32.
GGUF_TYPES = {
    "Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "IQ4_NL": 4, "IQ4_XS": 4,
    "Q4_K": 4, "Q5_K": 5,
}  # fmt: skip
GGUF_K_TYPES = frozenset(("Q4_K", "Q5_K"))
GGUF_MIN_TYPES = GGUF_K_TYPES | {"Q4_1", "Q5_1", "Q2_K"}
# Types whose min is a super-block's dmin times a small integer m: held in qtensor's compact
# form (m and dmin; Q4_1 / Q5_1 store each block's min as a float16).
GGUF_COMPACT_MINS = frozenset(("Q4_K", "Q5_K", "Q2_K"))
GGUF_LOOKUP_TYPES = frozenset(("IQ4_NL", "IQ4_XS"))
GGUF_BLOCK = 32  # weights per block (a K-quant's group)
GGUF_SUPER_BLOCK = 256  # weights per K-quant super-block
# Types with a scale per group of 16, held as 8-bit codes with a zero point and scale d * sc
# per 16 (exact in float32) for attention and MLP projections (experts included) on the CPU
# (models/gguf.py decides per load; an LM head in them stays int8
# per row), and for an untied embedding table on any device (looked up, not multiplied). Q6_K:
# sc a signed 8-bit multiple of the float16 d, codes 0..63, weight = d * sc * (q - 32). Q3_K:
# sc a 6-bit multiple less 32, codes 0..7, weight = d * sc * (q - 4). Q2_K: 4-bit multiples sc
# of d and m of dmin, codes 0..3, weight = d * sc * q - dmin * m (held with a min per 16).
GGUF_GROUP_16_TYPES = {"Q6_K": 6, "Q3_K": 3, "Q2_K": 2}
GGUF_GROUP_16 = 16
GGUF_PROJECTION_TYPES = {**GGUF_TYPES, **GGUF_GROUP_16_TYPES}


def gguf_held_bits(kind: str) -> int:
    """The bits of the codes minisgl holds a GGUF type's weights in: 4 for 4-bit codes, else 8
    (5- and 6-bit codes, IQ4's table values)."""
    return 4 if GGUF_PROJECTION_TYPES[kind] == 4 and kind not in GGUF_LOOKUP_TYPES else 8


INT4_GROUP = 128  # --quantization int4's group
FP8_BLOCK = 128  # --quantization fp8's block (rows x input features)


@dataclass(frozen=True)
class QuantScheme:
    """method: fp8 (block/tensor/channel float8 e4m3 codes), awq, gptq, compressed-tensors
    (integer codes), or int8/int4 (made at load). group_size: input features per scale; 0
    means a whole row (per channel).
    source: "checkpoint" (quantization_config) or "load" (--quantization)."""

    method: str
    bits: int
    group_size: int
    zero_point: bool = False
    desc_act: bool = False
    # GPTQ v1 ("gptq") stores each zero point minus one; "gptq_v2" stores it as it is.
    zeros_minus_one: bool = False
    # Symmetric codes whose stored zero points are the midpoint either as it is or minus one
    # (AutoRound's GPTQ-layout exports, whose config does not say which): read as the midpoint.
    midpoint_zeros: bool = False
    origin: str = ""  # the tool whose config named the layout (auto-round), for the log
    gguf_type: str = ""  # a GGUF file's block type (Q8_0, Q4_0)
    # The LM head a GGUF file stores quantized, as --lm-head-quantization auto holds it: its
    # own blocks (Q8_0 / Q4_0 / Q5_0), or int8 per row made from another type's values.
    lm_head: QuantScheme | None = None
    # An untied embedding table a GGUF file stores in a type minisgl holds: its own blocks,
    # looked up row by row (None: float, or dequantized at load).
    embedding: QuantScheme | None = None
    # fp8: how its scales are laid out ("block" [N/bn, K/bk], "channel" [N, 1], "tensor").
    fp8_scales: str = ""
    fp8_scale_name: str = ""  # weight_scale_inv (Qwen/DeepSeek fp8) or weight_scale (c-t)
    # compressed-tensors integer codes: packed in int32 words (pack-quantized, `weight_packed`)
    # or one int8 a weight (int-quantized / naive-quantized, `weight`).
    packed: bool = False
    source: str = "checkpoint"
    # Modules in another format than this one, as (pattern, its scheme, or None: float), the
    # first match deciding: modules_to_not_convert / ignore (None), then a mixed-precision
    # checkpoint's other formats. Patterns as names() reads them.
    overrides: tuple[tuple[str, QuantScheme | None], ...] = ()

    @property
    def mins(self) -> bool:
        """Whether groups carry a float min besides the scale (GGUF's K-quants, Q4_1, Q5_1)."""
        return self.gguf_type in GGUF_MIN_TYPES

    @property
    def mins_per(self) -> int:
        """Groups under one dmin where the mins are held compact (qtensor), else 0."""
        compact = self.gguf_type in GGUF_COMPACT_MINS
        return GGUF_SUPER_BLOCK // self.group_size if compact else 0

    def for_module(self, prefix: str) -> QuantScheme | None:
        """The scheme module `prefix` (an HF module name) is stored in; None: in float."""
        for pattern, scheme in self.overrides:
            if names(pattern, prefix):
                return scheme
        return self

    def describe(self) -> str:
        """One line for the start-up log and the metrics' info gauge."""
        where = "quantized at load" if self.source == "load" else "from the checkpoint"
        where += f", {self.origin}" if self.origin else ""
        line = f"{self._core()} ({where})"
        others = [o for _, o in self.overrides if o is not None and o._core() != self._core()]
        if others:
            kinds = sorted({o._core() for o in others})
            n = len(others)
            line += f"; {n} module pattern{'s' * (n > 1)} in " + " / ".join(kinds)
        return line

    def _core(self) -> str:
        if self.method == "gguf":
            per = "a scale and a min" if self.mins else "a scale"
            return f"gguf {self.gguf_type} ({self.bits}-bit, {per} per {self.group_size})"
        if self.method == "fp8":
            how = (
                f"{self.fp8_scales} scales"
                if self.fp8_scales != "block"
                else f"{self.group_size}x{self.group_size} block scales"
            )
            core = f"fp8 e4m3, {how}"
        else:
            group = "per channel" if self.group_size == 0 else f"group {self.group_size}"
            zeros = ", zero points" if self.zero_point else ", symmetric"
            order = ", desc_act" if self.desc_act else ""
            name = self.method
            if self.method == "compressed-tensors":
                name += " pack-quantized" if self.packed else " int-quantized"
            core = f"{name} {self.bits}-bit, {group}{zeros}{order}"
        return core


def names(pattern: str, prefix: str) -> bool:
    """Whether a config's module pattern names module `prefix`: "re:<regex>" matched from the
    name's start (as compressed-tensors, GPTQModel and AutoRound match), else the module's
    name, a trailing part of it, or a dotted fragment of it (modules_to_not_convert's
    "mlp.down_proj" or "layers.1")."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], prefix) is not None
    return prefix == pattern or prefix.endswith("." + pattern) or f".{pattern}." in f".{prefix}."


def _unsupported(what: str) -> ValueError:
    return ValueError(
        f"unsupported quantization_config: {what}; minisgl loads: " + "; ".join(SUPPORTED)
    )


def parse_quantization_config(raw: dict[str, Any] | None) -> QuantScheme | None:
    """config.json's `quantization_config` -> a scheme (None: a float checkpoint)."""
    if not raw:
        return None
    method = str(raw.get("quant_method", "")).lower()
    parsers = {
        "fp8": _fp8,
        "compressed-tensors": _compressed_tensors,
        "awq": _awq,
        "gptq": _gptq,
        "auto-round": _auto_round,
        "intel/auto-round": _auto_round,
        "gguf": _gguf,
    }
    if method in parsers:
        scheme = parsers[method](raw)
        # Modules the config keeps in float come first: they are float whatever else names
        # them (as compressed-tensors' `ignore` wins over its groups' targets).
        unconverted = raw.get("modules_to_not_convert") or raw.get("ignore") or []
        floats = tuple((str(m), None) for m in unconverted)
        return replace(scheme, overrides=floats + scheme.overrides)
    raise _unsupported(f"quant_method {method or None!r}")


def _fp8(raw: dict[str, Any]) -> QuantScheme:
    fmt = str(raw.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise _unsupported(f"fp8 fmt {fmt!r}")
    if raw.get("activation_scheme", "dynamic") != "dynamic":
        raise _unsupported(f"fp8 activation_scheme {raw.get('activation_scheme')!r}")
    block = raw.get("weight_block_size")
    if block is None:
        return QuantScheme("fp8", 8, 0, fp8_scales="tensor", fp8_scale_name="weight_scale_inv")
    if len(block) != 2 or block[0] != block[1]:
        raise _unsupported(f"fp8 weight_block_size {block!r} (square blocks only)")
    return QuantScheme(
        "fp8",
        8,
        int(block[1]),
        fp8_scales="block",
        fp8_scale_name="weight_scale_inv",
    )


def _compressed_tensors(raw: dict[str, Any]) -> QuantScheme:
    # Each changes what the weights mean at run time (online rotations, KV cache scales,
    # sparse storage): loading the weights without it would answer wrong, without a word.
    if raw.get("transform_config"):
        raise _unsupported("compressed-tensors transform_config (online rotations)")
    if raw.get("kv_cache_scheme"):
        raise _unsupported("compressed-tensors kv_cache_scheme (a quantized KV cache's scales)")
    sparsity = raw.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":  # "dense": sparse values, stored densely
        raise _unsupported(f"compressed-tensors sparsity format {sparsity.get('format')!r}")
    groups = list((raw.get("config_groups") or {}).values())
    if not groups:
        raise _unsupported("compressed-tensors without config_groups")
    schemes = [_ct_group(g, raw.get("format")) for g in groups]
    if len(groups) == 1:
        return schemes[0]
    # Mixed precision: the group that targets every Linear is the rest's format, the others'
    # targets (module names or "re:" patterns) are in theirs; with no such group, modules no
    # group targets are float.
    overrides: list[tuple[str, QuantScheme | None]] = []
    base = None
    for g, scheme in zip(groups, schemes, strict=True):
        targets = [str(t) for t in g.get("targets") or []]
        if "Linear" in targets:
            if base is not None:
                raise _unsupported("compressed-tensors with two config_groups targeting Linear")
            base = scheme
        overrides += [(t, scheme) for t in targets if t != "Linear"]
    if base is None:
        base, overrides = schemes[0], [*overrides, ("re:.*", None)]
    return replace(base, overrides=tuple(overrides))


def _ct_group(group: dict[str, Any], top_format: Any) -> QuantScheme:
    # A group's own format (compressed-tensors writes one per group) over the top-level one,
    # which reads "mixed-precision" where the groups' differ.
    fmt = group.get("format") or top_format
    w = group.get("weights") or {}
    if w.get("dynamic"):
        raise _unsupported("compressed-tensors dynamic weight quantization")
    act = group.get("input_activations")
    if act and not act.get("dynamic", False):
        raise _unsupported("compressed-tensors static activation scales (input_scale)")
    if w.get("type") == "int":
        return _ct_int(fmt, w)
    if fmt not in ("float-quantized", "naive-quantized"):
        raise _unsupported(f"compressed-tensors format {fmt!r} for {w.get('type')!r} weights")
    if w.get("type") != "float" or int(w.get("num_bits", 0)) != 8:
        raise _unsupported(
            f"compressed-tensors weights {w.get('type')!r} {w.get('num_bits')!r}-bit"
        )
    if not w.get("symmetric", True):
        raise _unsupported("compressed-tensors asymmetric float weight quantization")
    strategy = w.get("strategy")
    if strategy == "block":
        block = w.get("block_structure") or []
        if len(block) != 2 or block[0] != block[1]:
            raise _unsupported(f"compressed-tensors block_structure {block!r}")
        return QuantScheme(
            "fp8", 8, int(block[1]), fp8_scales="block", fp8_scale_name="weight_scale"
        )  # fmt: skip
    if strategy not in ("tensor", "channel"):
        raise _unsupported(f"compressed-tensors weight strategy {strategy!r}")
    return QuantScheme(
        "fp8", 8, 0, fp8_scales=str(strategy), fp8_scale_name="weight_scale",
    )  # fmt: skip


def _ct_int(fmt: Any, w: dict[str, Any]) -> QuantScheme:
    """compressed-tensors integer weights (llm-compressor's W4A16, W8A16 and W8A8): codes
    q in [-2^(b-1), 2^(b-1)), weight = (q - zero_point) * scale per group, channel or tensor."""
    bits = int(w.get("num_bits", 0))
    packed = fmt == "pack-quantized"
    if not (packed and bits in (4, 8)) and not (
        fmt in ("int-quantized", "naive-quantized") and bits == 8
    ):
        raise _unsupported(f"compressed-tensors format {fmt!r} with {bits}-bit int weights")
    strategy = w.get("strategy")
    if strategy == "group":
        size = int(w.get("group_size") or 0)
        if size <= 0:
            raise _unsupported(f"compressed-tensors group strategy with group_size {size}")
    elif strategy in ("channel", "tensor"):
        size = 0
    else:
        raise _unsupported(f"compressed-tensors int weight strategy {strategy!r}")
    actorder = w.get("actorder")
    if actorder not in (None, False, "weight", "group", "static", "dynamic"):
        raise _unsupported(f"compressed-tensors actorder {actorder!r}")
    return QuantScheme(
        "compressed-tensors",
        bits,
        size,
        zero_point=not w.get("symmetric", True),
        # actorder "group" ("dynamic" in older releases) stores each input feature's group
        # (weight_g_idx); "weight" ("static") only reordered the calibration: groups in order.
        desc_act=actorder in ("group", "dynamic") and size > 0,
        packed=packed,
    )


def _awq(raw: dict[str, Any]) -> QuantScheme:
    bits = int(raw.get("bits", raw.get("w_bit", 0)))
    version = str(raw.get("version", "gemm")).lower()
    zero = bool(raw.get("zero_point", True))
    group = int(raw.get("group_size", raw.get("q_group_size", 128)))
    if bits != 4 or version != "gemm" or not zero or group <= 0:
        raise _unsupported(
            f"awq bits={bits} version={version!r} zero_point={zero} group_size={group}"
        )
    return QuantScheme("awq", 4, group, zero_point=True)


def _gptq_layout(layer: dict[str, Any], what: str, **how: Any) -> QuantScheme:
    """GPTQ's layout with a layer's `bits`, `group_size` (-1: one group a row) and `sym`, as
    GPTQ configs and AutoRound's auto_gptq exports name them."""
    bits, group = int(layer.get("bits", 0)), int(layer.get("group_size", 128))
    if bits not in (4, 8) or group == 0 or group < -1:
        raise _unsupported(f"{what} bits={bits} group_size={group}")
    sym = bool(layer.get("sym", True))
    return QuantScheme("gptq", bits, max(group, 0), zero_point=not sym, **how)


def _gptq(raw: dict[str, Any]) -> QuantScheme:
    fmt = str(raw.get("checkpoint_format", raw.get("format", "gptq"))).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _unsupported(f"gptq checkpoint_format={fmt!r}")
    if raw.get("lm_head"):
        raise _unsupported("gptq with a quantized lm_head")

    def scheme(layer: dict[str, Any]) -> QuantScheme:
        # With one group per row (-1) the order of the input features changes nothing.
        desc_act = bool(layer.get("desc_act", False)) and int(layer.get("group_size", 128)) > 0
        return _gptq_layout(layer, "gptq", desc_act=desc_act, zeros_minus_one=fmt == "gptq")

    # GPTQModel's `dynamic`: per-module overrides, "-:<regex>" keeping modules in float,
    # "+:<regex>" (or a bare regex) giving them other bits, group_size, sym or desc_act.
    overrides: list[tuple[str, QuantScheme | None]] = []
    for key, layer in (raw.get("dynamic") or {}).items():
        skip = key.startswith("-:")
        pattern = "re:" + (key[2:] if key[:2] in ("-:", "+:") else key)
        overrides.append((pattern, None if skip else scheme(raw | dict(layer or {}))))
    return replace(scheme(raw), overrides=tuple(overrides))


def _auto_round(raw: dict[str, Any]) -> QuantScheme:
    """Intel's AutoRound exports: its int codes in GPTQ's (v1) or AutoAWQ's layout;
    extra_config gives layers other bits, group_size or sym (16 bits and more: float)."""
    packing = str(raw.get("packing_format", "auto_round:auto_gptq")).lower()

    def scheme(layer: dict[str, Any]) -> QuantScheme:
        if str(layer.get("data_type", "int")).lower() != "int":
            raise _unsupported(f"auto-round data_type {layer.get('data_type')!r}")
        bits, group = int(layer.get("bits", 0)), int(layer.get("group_size", 128))
        sym = bool(layer.get("sym", True))
        if packing == "auto_round:auto_awq" and bits == 4 and group > 0:
            return QuantScheme("awq", 4, group, zero_point=True, origin="auto-round")
        if packing != "auto_round:auto_gptq":
            raise _unsupported(f"auto-round packing_format {packing!r} with {bits} bits")
        return _gptq_layout(
            layer,
            "auto-round",
            zeros_minus_one=True,  # AutoGPTQ's layout, as vLLM and SGLang read it
            midpoint_zeros=sym,
            origin="auto-round",
        )

    overrides: list[tuple[str, QuantScheme | None]] = []
    for name, layer in (raw.get("extra_config") or {}).items():
        merged = raw | dict(layer or {})
        quantized = int(merged.get("bits", 0)) < 16
        overrides.append((str(name), scheme(merged) if quantized else None))
    return replace(scheme(raw), overrides=tuple(overrides))


def _gguf(raw: dict[str, Any]) -> QuantScheme:
    """The config models/gguf.py writes for a GGUF file: `modules`, each projection held
    quantized with its GGUF type (the others are float in the file, or dequantized at load).
    The most common type is the scheme's, the others its overrides."""
    modules = {str(m): str(t) for m, t in (raw.get("modules") or {}).items()}
    unknown = sorted(set(modules.values()) - set(GGUF_PROJECTION_TYPES))
    if unknown:
        raise _unsupported(f"gguf modules of types {unknown}")
    counts = Counter(sorted(modules.values()))  # ties: the first name in order
    # (No module held: only the head is quantized; the layers' scheme is then never asked.)
    base = counts.most_common(1)[0][0] if counts else "Q8_0"

    def scheme(kind: str) -> QuantScheme:
        group = GGUF_GROUP_16 if kind in GGUF_GROUP_16_TYPES else GGUF_BLOCK
        return QuantScheme("gguf", gguf_held_bits(kind), group, gguf_type=kind, origin="llama.cpp")

    others = tuple((m, scheme(k)) for m, k in modules.items() if k != base)
    head = raw.get("lm_head")
    if head is None:
        lm_head = None
    elif head in GGUF_TYPES:
        lm_head = scheme(str(head))
    elif head == AUTO_LM_HEAD:
        lm_head = head_scheme(AUTO_LM_HEAD)
    else:
        raise _unsupported(f"gguf lm_head {head!r}")
    table = raw.get("embed_tokens")
    if table is not None and table not in GGUF_PROJECTION_TYPES:
        raise _unsupported(f"gguf embed_tokens {table!r}")
    embedding = scheme(str(table)) if table is not None else None
    return replace(scheme(base), overrides=others, lm_head=lm_head, embedding=embedding)


def load_scheme(method: str) -> QuantScheme:
    """--quantization's scheme for a float checkpoint: int8 per channel (symmetric), int4 per
    group of INT4_GROUP with zero points, fp8 e4m3 with FP8_BLOCK x FP8_BLOCK block scales."""
    if method == "int8":
        return QuantScheme("int8", 8, 0, source="load")
    if method == "int4":
        return QuantScheme("int4", 4, INT4_GROUP, zero_point=True, source="load")
    if method == "fp8":
        return QuantScheme(
            "fp8", 8, FP8_BLOCK, fp8_scales="block", fp8_scale_name="weight_scale_inv",
            source="load",
        )  # fmt: skip
    raise ValueError(f"unknown --quantization {method!r}; choose from {', '.join(LOAD_METHODS)}")


# What --lm-head-quantization auto makes of the head under --quantization: 8 bits whatever the
# body's format. The head's error goes straight into every logit (llama.cpp's Q4_0 and Q8_0
# files keep theirs at Q6_K / Q8_0 for the same reason), and int8 per channel is exact to
# 1/254 of a row's largest weight at 1 byte per weight, against bf16's 2.
AUTO_LM_HEAD = "int8"


def head_scheme(method: str) -> QuantScheme:
    """The LM head's scheme for --lm-head-quantization `method`: int8 per channel, int4 as
    --quantization int4 makes it, fp8 e4m3 with one scale per row (not 128x128 blocks: a
    vocabulary split over tensor-parallel ranks need not start on a block of rows)."""
    if method == "fp8":
        return QuantScheme(
            "fp8", 8, 0, fp8_scales="channel", fp8_scale_name="weight_scale", source="load"
        )
    return load_scheme(method)


def lm_head_scheme(
    lm_head: str, quantization: str | None, checkpoint: QuantScheme | None
) -> QuantScheme | None:
    """The scheme the LM head is quantized with at load (None: it stays as the checkpoint has
    it). auto: int8 per channel for --quantization (the format promises its bytes for the
    whole step, the head included), the checkpoint's own head otherwise (quantized
    checkpoints keep theirs in float: minisgl refuses a quantized lm_head tensor)."""
    if lm_head not in LM_HEAD_QUANTIZATIONS:
        raise ValueError(
            f"unknown --lm-head-quantization {lm_head!r}; choose from "
            f"{', '.join(LM_HEAD_QUANTIZATIONS)}"
        )
    if lm_head == "auto" and not quantization and checkpoint is not None:
        return checkpoint.lm_head
    if lm_head == "none" or (lm_head == "auto" and not quantization):
        return None
    if lm_head == "auto":
        return head_scheme(AUTO_LM_HEAD)
    return head_scheme(lm_head)
