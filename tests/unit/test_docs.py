"""README.md and docs/ stand on their own and describe what the code does."""

from __future__ import annotations

import re
from pathlib import Path

from minisgl.metrics import names

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_docs_point_nowhere_outside_the_repository() -> None:
    for doc in DOCS:
        text = doc.read_text()
        assert "shared/" not in text, f"{doc.name} points at the internal shared/ notes"
        assert not re.search(r"\.\./", text), f"{doc.name} points outside the repository"


def test_relative_links_and_images_exist() -> None:
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)\)", doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"


def test_metrics_doc_lists_every_metric_and_only_those() -> None:
    text = (ROOT / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `(minisgl_[a-z0-9_]+)` \| \S", text, flags=re.M))
    exposed = {*names.HISTOGRAMS, *names.GAUGES, *names.COUNTERS}
    assert documented == exposed
    for label in (*names.FINISH_REASONS, *names.KV_PAGE_STATES):
        assert f"`{label}`" in text


def test_readme_shows_the_playground_and_the_install_choices() -> None:
    text = (ROOT / "README.md").read_text()
    assert "![" in text and "(docs/playground.png)" in text
    assert (ROOT / "docs" / "playground.png").stat().st_size > 10_000
    for word in ("MINISGL_TORCH=cpu", "MINISGL_TORCH=cuda", "MINISGL_NO_APT=1"):
        assert word in text
