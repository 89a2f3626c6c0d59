"""Which model class serves which `config.json` architecture (torch-free: classes load lazily).

A checkpoint names its class in `architectures`; the first name listed here wins. Adding an
architecture is one entry and one file in this folder.
"""

from __future__ import annotations

import importlib
from typing import Any

# architecture -> "module:class"
ARCHITECTURES: dict[str, str] = {
    "Qwen3ForCausalLM": "minisgl.models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "minisgl.models.qwen3_moe:Qwen3MoeForCausalLM",
    "Qwen2ForCausalLM": "minisgl.models.qwen2:Qwen2ForCausalLM",
    "LlamaForCausalLM": "minisgl.models.llama:LlamaForCausalLM",
}


def supported_architecture(architectures: list[str]) -> str | None:
    """The first of a checkpoint's `architectures` that minisgl implements."""
    return next((a for a in architectures if a in ARCHITECTURES), None)


def model_class(architecture: str) -> Any:
    """The model class for `architecture` (imported on first use: it needs torch)."""
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; minisgl supports "
            f"{', '.join(ARCHITECTURES)}"
        )
    module, _, name = ARCHITECTURES[architecture].partition(":")
    return getattr(importlib.import_module(module), name)
