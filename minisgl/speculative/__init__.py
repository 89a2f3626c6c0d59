"""Speculative decoding: drafters propose tokens, the engine verifies them in one forward.

Imports run down: the engine imports this package; it never imports the engine or server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from minisgl.speculative.drafter import Drafter

if TYPE_CHECKING:
    from minisgl.config import EngineArgs

__all__ = ["Drafter", "make_drafter"]


def make_drafter(args: EngineArgs, model_config: Any, device: Any, dtype: Any) -> Drafter | None:
    """The drafter `--speculative-algorithm` names, or None when speculation is off."""
    algo = args.speculative_algorithm
    if algo is None:
        return None
    if algo == "ngram":
        from minisgl.speculative.ngram import NgramDrafter

        return NgramDrafter(
            min_window=args.speculative_ngram_min_match_window_size,
            max_window=args.speculative_ngram_max_match_window_size,
        )
    if algo == "eagle3":
        # Lazily: ngram runs never import the draft head's model code.
        from minisgl.speculative.eagle3_drafter import make_eagle3_drafter

        return make_eagle3_drafter(args, model_config, device, dtype)
    raise ValueError(f"unknown speculative algorithm {algo!r}")
