"""minisgl: a compact, fast LLM inference server for the Qwen3 family."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from minisgl.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from minisgl.llm import LLM


def __getattr__(name: str) -> Any:
    # LLM pulls in torch; keep `import minisgl` (config, messages, the operator) light.
    if name == "LLM":
        from minisgl.llm import LLM

        return LLM
    raise AttributeError(f"module 'minisgl' has no attribute {name!r}")
