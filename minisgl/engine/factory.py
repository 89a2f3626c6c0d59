"""One entry point for whoever needs an engine: a local one, or rank 0 of a TP group."""

from __future__ import annotations

from minisgl.config import EngineArgs, check_ranges
from minisgl.engine.engine import Engine


def create_engine(args: EngineArgs) -> Engine:
    check_ranges(args)  # e.g. LLM(num_pages=0): refused, not read as "derive it"
    if args.tp_size == 1:
        return Engine(args)
    from minisgl.engine.tp_engine import TPEngine

    return TPEngine(args)  # type: ignore[return-value]  # same interface, by duck typing


def shutdown_engine(engine: Engine) -> None:
    """Stop follower ranks, if any (a local engine holds nothing that needs stopping)."""
    stop = getattr(engine, "shutdown", None)
    if stop is not None:
        stop()
