"""The loader's hooks (models/loader.py): the scheme a load runs with, the checkpoint's layout
under it, and the model's quantized layers swapped in before it is materialised."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import cast

import torch

from minisgl import hugepages
from minisgl.layers import cpu_kernels
from minisgl.layers.embedding import ParallelLMHead
from minisgl.models.config import ModelConfig
from minisgl.quant import cpu_choice, cpu_vpanel
from minisgl.quant import layout as quant_layout
from minisgl.quant.attach import after_materialise, attach, format_name, summary, weight_bytes
from minisgl.quant.layout import EMBEDDING_TENSOR, CheckpointLayout, Header, read_headers, scan
from minisgl.quant.qtensor import QTensor, streamed
from minisgl.quant.scheme import QuantScheme, lm_head_scheme, load_scheme
from minisgl.quant.weight import QuantWeight, multiplied_weights

__all__ = [
    "after_materialise",
    "assemble",
    "attach",
    "checkpoint_layout",
    "for_device",
    "prepare_cpu",
    "read_headers",
    "scheme",
    "summary",
    "weights_info",
]
logger = logging.getLogger(__name__)


def scheme(config: ModelConfig, quantization: str | None) -> QuantScheme | None:
    """The checkpoint's own quantization, or --quantization's for a float checkpoint."""
    if not quantization:
        return config.quantization
    if config.quantization is not None:
        raise ValueError(
            f"--quantization {quantization} is for float checkpoints; this one is already "
            f"quantized ({config.quantization.describe()})"
        )
    return load_scheme(quantization)


def checkpoint_layout(
    headers: dict[str, Header], config: ModelConfig, quantization: str | None, lm_head: str = "auto"
) -> CheckpointLayout:
    """`headers`: every checkpoint tensor's (shape, dtype), read_headers' or a GGUF file's."""
    head = lm_head_scheme(lm_head, quantization, config.quantization)
    # Tied: the embedding table is the head, quantized once and looked up from its codes.
    tied = config.tie_word_embeddings
    head_tensor = "model.embed_tokens.weight" if tied else "lm_head.weight"
    if head is not None and head.source == "checkpoint" and head_tensor in headers:
        # Stored quantized (a GGUF file's blocks): scanned as the float weight it stands for.
        headers = {**headers, head_tensor: (headers[head_tensor][0], "F32")}
    table = None if tied or config.quantization is None else config.quantization.embedding
    table = table if EMBEDDING_TENSOR in headers else None
    if table is not None:  # its blocks, as the head's
        headers = {**headers, EMBEDDING_TENSOR: (headers[EMBEDDING_TENSOR][0], "F32")}
    layout = scan(headers, scheme(config, quantization))
    layout.head, layout.head_tensor = head, head_tensor
    layout.embedding = table
    return layout


def assemble(
    tensors: Iterable[tuple[str, torch.Tensor]], layout: CheckpointLayout
) -> Iterator[tuple[str, torch.Tensor]]:
    """layout.assemble for the model's load_weights: a quantized linear's weight comes as a
    QTensor, which answers what the layers' load methods ask of a weight tensor (dim, narrow,
    and being copied into the layer's QuantWeight)."""
    return cast(Iterator[tuple[str, torch.Tensor]], quant_layout.assemble(tensors, layout))


def prepare_cpu(model: torch.nn.Module, x_dtype: torch.dtype, tuning: str) -> str:
    """Give the model's quantized weights on the CPU the matmul measured fastest per row count
    for their shape (cpu_choice.py; a mixture's experts included), tuning once per distinct
    shape and code kind; the one log line of what was picked ("" where nothing was)."""
    by_shape: dict[tuple[object, ...], list[QuantWeight]] = {}
    for m in multiplied_weights(model):
        if m.codes.device.type == "cpu":
            key = (tuple(m.codes.shape[-2:]), m.codes.dtype, m.bits, m.group_size, m.experts > 0)
            by_shape.setdefault(key, []).append(m)
    # All on huge pages, in one mapping (the small ones too), before they are timed.
    hugepages.move_all_onto([t for hs in by_shape.values() for h in hs for t in streamed(h)])
    holders = list(by_shape.values())
    # Timed over every layer's weight of the shape (every expert's, for a mixture): cold reads.
    groups = [[e for h in hs for e in _views(h)] for hs in holders]
    # Each may be repacked for cpu_choice's vnni_panel (a tied table's lookups then gather
    # their rows out of the panels; a mixture's experts are packed a run of them at a time).
    kernels, line = cpu_choice.kernels_for(groups, x_dtype, tuning)
    for hs, kernel in zip(holders, kernels, strict=True):
        pack = kernel is not None and set(kernel.picks) <= set(cpu_choice.PACKED_KERNELS)
        for h in hs:
            if pack:
                h.pack_vnni()
            h.kernel = kernel
    return line


def move_to_huge_pages(w: QuantWeight | QTensor) -> None:
    """A CPU weight's codes, scales and zero points onto huge pages, in place, in one mapping
    (hugepages.py): a decode step streams them all, as it does the float weights the chooser
    moves there (one thread on an Intel Xeon with AVX512-BF16, bf16: B=1 step 139 -> 101 ms).
    prepare_cpu moves all of a model's at once; timed after the move, so the picks are
    measured on the pages they will run on."""
    hugepages.move_all_onto(streamed(w))


def _views(h: QuantWeight) -> list[QTensor]:
    return [h[e] for e in range(h.experts)] if h.experts else [h.view()]


def weights_info(
    model: torch.nn.Module,
    config: ModelConfig,
    quantization: str | None,
    lm_head_quantization: str = "auto",
) -> dict:
    """What /metrics' model info says of the weights: the layers' format ("none" unquantized),
    the LM head's ("none" float: a float model's head may be quantized alone), whether integer
    weights multiply x rounded to 8 bits ("int8", --cpu-quantized-activations int8 where it
    takes any weight) or as it is ("exact"), and the bytes this rank holds (quantized codes and
    scales plus the float tensors)."""
    quantized, _, other = weight_bytes(model)
    name = format_name(
        model, config.quantization or (load_scheme(quantization) if quantization else None)
    )
    head = lm_head_scheme(lm_head_quantization, quantization, config.quantization)
    return {
        "quantization": name,
        "lm_head": head.method if head is not None and _head_quantized(model) else "none",
        "activations": _activations(model),
        "weight_bytes": quantized + other,
    }


def _head_quantized(model: torch.nn.Module) -> bool:
    return any(
        isinstance(m, ParallelLMHead) and isinstance(m.weight, QuantWeight) for m in model.modules()
    )


def _activations(model: torch.nn.Module) -> str:
    """What integer weights multiply: x rounded to 8 bits ("int8": --cpu-quantized-activations
    int8 with weights it takes, cpu_vpanel.rounds_x_in_int8) or "exact"."""
    weights = multiplied_weights(model)
    if not weights or any(w.codes.device.type == "cuda" for w in weights):
        return "exact"  # float weights, or a GPU's (the flag is for the CPU kernels)
    if cpu_kernels.quantized_activations() != "int8" or not cpu_kernels.int8_activation_rows():
        return "exact"
    views = (w.view(0 if w.experts else None) for w in weights)
    return "int8" if any(cpu_vpanel.rounds_x_in_int8(v) for v in views) else "exact"


def for_device(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """On a GPU, every quantized weight converted for a torch kernel that runs it (or
    dequantized where none does), said in one log line (cuda_matmul.py). On the CPU the loaded
    layout stays: its C kernels read it as it is."""
    if device.type != "cuda":
        return
    from minisgl.quant import cuda_matmul

    line = cuda_matmul.prepare(model, dtype, torch.cuda.get_device_capability(device))
    if line:
        logger.info(line)
