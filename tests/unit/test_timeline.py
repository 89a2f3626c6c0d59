"""The debug timeline: off by default (no file), one line per event when enabled, read back in
time order per request."""

from __future__ import annotations

from pathlib import Path

import pytest

from minisgl import timeline


def test_off_by_default_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timeline, "_PATH", None)
    monkeypatch.setattr(timeline, "_FILE", None)
    timeline.mark("r1", "received")
    assert not timeline.enabled() and list(tmp_path.iterdir()) == []


def test_marks_are_read_back_per_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tl.txt"
    monkeypatch.setattr(timeline, "_PATH", str(path))
    monkeypatch.setattr(timeline, "_FILE", None)
    for stage in timeline.STAGES:
        timeline.mark("r1", stage)
    timeline.mark("-", "step_begin")
    timeline.mark("r2", "received")
    assert timeline._FILE is not None
    timeline._FILE.close()
    events = timeline.read(str(path))
    assert [s for s, _ in events["r1"]] == list(timeline.STAGES)
    times = [t for _, t in events["r1"]]
    assert times == sorted(times)
    assert [s for s, _ in events["r2"]] == ["received"] and "-" in events
