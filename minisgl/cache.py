"""Where minisgl keeps what it makes once per machine: compiled CPU kernels, kernel timings,
the tokenizer the test fixtures build, the directories GGUF files are opened through.
MINISGL_CACHE_DIR, else $XDG_CACHE_HOME/minisgl, else ~/.cache/minisgl."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("MINISGL_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "minisgl"
