"""Which of a checkpoint's linears are quantized, checked from the safetensors headers before
anything is built, and the stream of tensors regrouped into one weight per linear.

Every tensor is either used or named in an error: a quantization tensor that belongs to no
layout of the scheme (an extra `weight_scale`, an `input_scale` minisgl would ignore, a
quantized router), fp8 codes in a checkpoint that declares no quantization, or a module listed
in `modules_to_not_convert` that is quantized anyway stop the load at start.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from minisgl.quant.formats import logical_shape, parts, read_linear
from minisgl.quant.qtensor import QTensor
from minisgl.quant.quantize import quantize
from minisgl.quant.scheme import GGUF_PROJECTION_TYPES, SUPPORTED, QuantScheme

# Suffixes only quantized checkpoints have (AutoAWQ, GPTQ, fp8, compressed-tensors, kv scales).
QUANT_SUFFIXES = frozenset(
    {
        "qweight",
        "qzeros",
        "scales",
        "g_idx",
        "weight_scale",
        "weight_scale_inv",
        "weight_zero_point",
        "weight_packed",
        "weight_shape",
        "weight_g_idx",
        "weight_global_scale",
        "input_scale",
        "input_global_scale",
        "k_scale",
        "v_scale",
    }
)
FLOAT8_DTYPES = ("F8_E4M3", "F8_E5M2")
# The linears minisgl can hold quantized: attention and MLP projections, experts included
# (never the embedding, the LM head or a mixture's router).
QUANTIZABLE = re.compile(
    r"model\.layers\.\d+\."
    r"(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|mlp\.experts\.\d+\.(gate|up|down)_proj)"
)

Header = tuple[tuple[int, ...], str]  # (shape, safetensors dtype)


EMBEDDING_TENSOR = "model.embed_tokens.weight"


@dataclass
class CheckpointLayout:
    scheme: QuantScheme | None
    # Every tensor the model reads, quantized linears as the float `.weight` they stand for.
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Quantized linears (HF module names) -> the suffixes of theirs the checkpoint has.
    quantized: dict[str, frozenset[str]] = field(default_factory=dict)
    # The LM head quantized at load (--lm-head-quantization): its scheme and the checkpoint
    # tensor it is made from (a tied model's embedding table, else lm_head.weight).
    head: QuantScheme | None = None
    head_tensor: str = ""
    # An untied embedding table held as the checkpoint stores it (a GGUF file's blocks).
    embedding: QuantScheme | None = None


def read_headers(files: Iterable[Path]) -> dict[str, Header]:
    from safetensors import safe_open

    out: dict[str, Header] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as h:
            for name in h.keys():  # noqa: SIM118 - safe_open is not a mapping
                s = h.get_slice(name)
                out[name] = (tuple(s.get_shape()), str(s.get_dtype()))
    return out


def scan(headers: dict[str, Header], scheme: QuantScheme | None) -> CheckpointLayout:
    """The checkpoint's layout under `scheme`, or ValueError naming every tensor that does not
    fit it (the first few)."""
    layout = CheckpointLayout(scheme)
    by_module: dict[str, dict[str, Header]] = {}
    for name, header in headers.items():
        prefix, _, suffix = name.rpartition(".")
        by_module.setdefault(prefix, {})[suffix] = header
    problems: list[str] = []
    for prefix, tensors in by_module.items():
        marked = sorted(
            s
            for s, (_, dt) in tensors.items()
            if s in QUANT_SUFFIXES or dt in FLOAT8_DTYPES or dt in GGUF_PROJECTION_TYPES
        )
        if not marked:
            layout.shapes |= {f"{prefix}.{s}": shape for s, (shape, _) in tensors.items()}
            if scheme is not None and scheme.source == "load" and QUANTIZABLE.fullmatch(prefix):
                layout.quantized[prefix] = frozenset({"weight"})
            continue
        first = f"{prefix}.{marked[0]}"
        if scheme is None:
            problems.append(
                f"{first} is a quantized tensor, but config.json has no quantization_config "
                f"(minisgl loads: {'; '.join(SUPPORTED)})"
            )
            continue
        if scheme.source == "load":
            problems.append(
                f"{first} is already quantized: --quantization is for float checkpoints"
            )
            continue
        module_scheme = scheme.for_module(prefix)
        if module_scheme is None:
            problems.append(
                f"{first}: {prefix} is in the quantization_config's modules_to_not_convert, "
                "but the checkpoint has it quantized"
            )
            continue
        if not QUANTIZABLE.fullmatch(prefix):
            problems.append(
                f"{first}: minisgl runs {prefix} unquantized (only attention and MLP "
                "projections are held quantized)"
            )
            continue
        required, optional = parts(module_scheme)
        present = set(tensors) - {"bias"}
        extra = sorted(present - set(required) - set(optional))
        missing = sorted(set(required) - present)
        how = f"the {module_scheme.method} layout of a linear is {', '.join(required)}"
        how += f" (and optionally {', '.join(optional)})" if optional else ""
        if extra:
            problems.append(f"{prefix}.{extra[0]} is not used: {how}")
            continue
        if missing:
            problems.append(f"{prefix} has no tensor {prefix}.{missing[0]}: {how}")
            continue
        shapes = {s: shape for s, (shape, _) in tensors.items()}
        layout.shapes[f"{prefix}.weight"] = logical_shape(module_scheme, shapes)
        if "bias" in tensors:
            layout.shapes[f"{prefix}.bias"] = tensors["bias"][0]
        layout.quantized[prefix] = frozenset(present)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ValueError("; ".join(problems[:3]) + more)
    return layout


def assemble(
    tensors: Iterable[tuple[str, torch.Tensor]], layout: CheckpointLayout
) -> Iterator[tuple[str, torch.Tensor | QTensor]]:
    """The checkpoint's tensors with each quantized linear's parts (in whatever order and
    shard they come) replaced by one `<module>.weight` QTensor, yielded as soon as its last
    part is read; a float checkpoint's linears quantized one by one under --quantization, and
    the LM head (a tied one: the embedding table) under --lm-head-quantization."""
    scheme = layout.scheme
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors:
        if layout.head is not None and name == layout.head_tensor:
            head = layout.head
            if head.source == "checkpoint":  # its own blocks (a GGUF file's)
                yield name, read_linear(name.removesuffix(".weight"), {"weight": t}, head)
            else:
                yield name, quantize(t, head)
            continue
        if layout.embedding is not None and name == EMBEDDING_TENSOR:
            yield name, read_linear(name.removesuffix(".weight"), {"weight": t}, layout.embedding)
            continue
        prefix, _, suffix = name.rpartition(".")
        want = layout.quantized.get(prefix)
        if scheme is None or want is None or suffix not in want:
            yield name, t
            continue
        if scheme.source == "load":
            yield name, quantize(t, scheme)
            continue
        got = pending.setdefault(prefix, {})
        got[suffix] = t
        if got.keys() == want:
            del pending[prefix]
            module_scheme = scheme.for_module(prefix)
            assert module_scheme is not None  # scan() let no float module's parts in
            yield f"{prefix}.weight", read_linear(prefix, got, module_scheme)
    if pending:  # the headers listed them: a file changed under us
        raise ValueError(f"checkpoint tensors of {next(iter(pending))} were not all read")
