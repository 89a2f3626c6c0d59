"""A headless Debian chromium driven by Playwright for Python (no downloaded browsers)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import pytest

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


def launch_browser() -> Iterator[Any]:
    """A browser for a test module, or a skip saying what is missing."""
    path = chromium_path()
    if path is None:
        pytest.skip(
            "no chromium on PATH: scripts/install.sh installs Debian's chromium where apt is "
            "usable (apt-get install chromium)"
        )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[dev]')")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=path, headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()
