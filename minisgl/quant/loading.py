"""The loader's hooks (models/loader.py): the scheme a load runs with, the checkpoint's layout
under it, and the model's quantized layers swapped in before it is materialised."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import cast

import torch

from minisgl.models.config import ModelConfig
from minisgl.quant import layout as quant_layout
from minisgl.quant.attach import after_materialise, attach, summary
from minisgl.quant.layout import CheckpointLayout, read_headers, scan
from minisgl.quant.scheme import QuantScheme, load_scheme

__all__ = ["after_materialise", "assemble", "attach", "checkpoint_layout", "scheme", "summary"]


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
    files: list[Path], config: ModelConfig, quantization: str | None
) -> CheckpointLayout:
    return scan(read_headers(files), scheme(config, quantization))


def assemble(
    tensors: Iterable[tuple[str, torch.Tensor]], layout: CheckpointLayout
) -> Iterator[tuple[str, torch.Tensor]]:
    """layout.assemble for the model's load_weights: a quantized linear's weight comes as a
    QTensor, which answers what the layers' load methods ask of a weight tensor (dim, narrow,
    and being copied into the layer's QuantWeight)."""
    return cast(Iterator[tuple[str, torch.Tensor]], quant_layout.assemble(tensors, layout))
