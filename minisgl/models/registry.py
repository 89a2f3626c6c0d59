"""Which model class serves which `config.json` architecture (torch-free: classes load lazily).

A checkpoint names its class in `architectures`; the first name listed here wins. Each entry
also names the transformers config class that reads that architecture's config.json, so every
spelling of a key transformers accepts (attribute_map aliases such as Qwen3-MoE's
num_experts / num_local_experts, rope_scaling / rope_parameters) reads the same here. Adding an
architecture is one entry and one file in this folder.
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple


class Entry(NamedTuple):
    model: str  # "module:class" of minisgl's model
    config: str  # transformers' config class that reads this architecture's config.json
    experts: bool = False  # its layers may be sparse (config.json's MoE keys apply)


ARCHITECTURES: dict[str, Entry] = {
    "Qwen3ForCausalLM": Entry("minisgl.models.qwen3:Qwen3ForCausalLM", "Qwen3Config"),
    "Qwen3MoeForCausalLM": Entry(
        "minisgl.models.qwen3_moe:Qwen3MoeForCausalLM", "Qwen3MoeConfig", experts=True
    ),
    "Qwen2ForCausalLM": Entry("minisgl.models.qwen2:Qwen2ForCausalLM", "Qwen2Config"),
    "LlamaForCausalLM": Entry("minisgl.models.llama:LlamaForCausalLM", "LlamaConfig"),
}


def supported_architecture(architectures: list[str]) -> str | None:
    """The first of a checkpoint's `architectures` that minisgl implements."""
    return next((a for a in architectures if a in ARCHITECTURES), None)


def _entry(architecture: str) -> Entry:
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"unsupported model architecture {architecture!r}; minisgl supports "
            f"{', '.join(ARCHITECTURES)}"
        )
    return ARCHITECTURES[architecture]


def has_experts(architecture: str) -> bool:
    """Whether the architecture's layers may be mixtures of experts."""
    return _entry(architecture).experts


def model_class(architecture: str) -> Any:
    """The model class for `architecture` (imported on first use: it needs torch)."""
    module, _, name = _entry(architecture).model.partition(":")
    return getattr(importlib.import_module(module), name)


def config_class(architecture: str) -> Any:
    """transformers' config class for `architecture` (imported on first use: transformers
    imports torch)."""
    import transformers

    return getattr(transformers, _entry(architecture).config)
