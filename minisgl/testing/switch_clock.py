"""A fake clock for the kernels' start-up measures of a C switch (cpu_kernels.time_switch):
tests that the switch ends on where its side ran faster, and off where it did not."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from minisgl.layers import cpu_kernels, cpu_linear

if TYPE_CHECKING:
    import pytest


def time_by_switch(
    monkeypatch: pytest.MonkeyPatch, module: Any, name: str, switch: Any, faster: bool
) -> None:
    """module.name (the kernel a measure runs) replaced by the same call that also advances a
    fake time.perf_counter: 0.9 s a run with the switch on where `faster`, 1.0 s with it on
    where not, 0.95 s with it off; so the measure finds the switch's side 3% faster exactly
    when `faster`. `switch`: a ctypes int, or a function of the call's arguments giving the
    one that call's run depends on (a measure of several switches, one per kind of weight)."""
    now = [0.0]
    real: Callable[..., Any] = getattr(module, name)

    def timed(*args: Any) -> Any:
        on = (switch(*args) if callable(switch) else switch).value
        now[0] += (0.9 if faster else 1.0) if on else 0.95
        return real(*args)

    monkeypatch.setattr(module, name, timed)
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])


def measure_only(monkeypatch: pytest.MonkeyPatch, module: Any, flag: str) -> None:
    """Every once-per-process start-up measure of `module` (its _*_MEASURED flags) marked done
    but `flag`, which is armed: a test times that one switch on its fake clock, and no other
    measure runs on it (one that did divided by the clock's zero)."""
    for name in vars(module):
        if name.startswith("_") and name.endswith("_MEASURED"):
            monkeypatch.setattr(module, name, name != flag)


def check_measured_once(
    monkeypatch: pytest.MonkeyPatch,
    kernel: str,
    switch: Any,
    flag: str,
    shape: str,
    faster: bool,
    offered: Callable[[list[str]], bool],
    small: tuple[int, int] = (64, 2048),
) -> None:
    """A start-up measure of cpu_kernels (its once-per-process `flag`) that times `kernel` with
    `switch` on the fake clock, on a small weight (the module's `shape` made `small`): where
    the chooser first offers the kernel (`offered` holds for cpu_linear.available's list), the
    switch ends on exactly where its side ran faster; flipped by hand, a second offer leaves it
    flipped (measured once). The switch's value is restored after."""
    time_by_switch(monkeypatch, cpu_kernels, kernel, switch, faster)
    measure_only(monkeypatch, cpu_kernels, flag)
    monkeypatch.setattr(cpu_kernels, shape, small)
    before = switch.value
    try:
        w = torch.randn(64, 256).bfloat16()
        assert offered(cpu_linear.available(w, torch.bfloat16))
        assert switch.value == int(faster)
        switch.value = 1 - int(faster)
        cpu_linear.available(w, torch.bfloat16)  # once per process: not measured again
        assert switch.value == 1 - int(faster)
    finally:
        switch.value = before
