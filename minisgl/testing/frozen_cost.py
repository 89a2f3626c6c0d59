"""A step-cost model frozen at a CPU-like shape, for tests of what speculation does.

The adaptive controller fits the engine's own step timings; on a loaded CI machine the tiny
test models' timings swing enough to change how many drafts a step gets. Tests that count
drafts or accepted tokens install this instead (the fit itself has its own tests)."""

from __future__ import annotations

from minisgl.speculative.adaptive import PRIOR_SLOPE_RATIO, StepCostModel


class FrozenCost(StepCostModel):
    """A step costs 1 + PRIOR_SLOPE_RATIO * n seconds (+0 verifying) at every size, as if
    measured just now; the timings the engine reports are recorded in `seen`, not fitted."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, bool, float]] = []

    def observe(self, scored_tokens: int, verify: bool, seconds: float) -> None:
        self.seen.append((scored_tokens, verify, seconds))

    @property
    def coefficients(self) -> tuple[float, float, float]:
        return 1.0, PRIOR_SLOPE_RATIO, 0.0

    def age(self, scored_tokens: int, verify: bool) -> float:
        return 0.0  # every size is known: no step is held plain to time it


def freeze_step_costs(engine) -> FrozenCost:
    """Install a FrozenCost in `engine`'s controller (it must speculate) and return it."""
    assert engine.adaptive is not None, "the engine does not speculate"
    cost = FrozenCost()
    engine.adaptive.cost = cost
    return cost
