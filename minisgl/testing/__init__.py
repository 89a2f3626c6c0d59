"""Offline test support: a random Qwen3 checkpoint with Qwen's real tokenizer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["write_fixture_model"]

if TYPE_CHECKING:
    from minisgl.testing.fixture import write_fixture_model


def __getattr__(name: str) -> Any:
    # Imported lazily so `python -m minisgl.testing.fixture` does not load the module twice.
    if name == "write_fixture_model":
        from minisgl.testing.fixture import write_fixture_model

        return write_fixture_model
    raise AttributeError(f"module 'minisgl.testing' has no attribute {name!r}")
