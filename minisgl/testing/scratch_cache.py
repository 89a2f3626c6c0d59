"""A minisgl cache directory of a test's own (MINISGL_CACHE_DIR, inherited by the processes the
test starts), sharing the machine's compiled CPU kernels, their timings and llama.cpp's
converter: what the test makes there (a GGUF file's prepared directory) goes with it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from minisgl.cache import cache_dir
from minisgl.testing.llama_cpp_converter import converter_dir

SHARED = ("kernels", "tuning")


@contextmanager
def scratch_cache(where: Path) -> Iterator[Path]:
    shared = [cache_dir() / name for name in SHARED] + [converter_dir()]
    where.mkdir(parents=True, exist_ok=True)
    for path in shared:
        path.mkdir(parents=True, exist_ok=True)
        (where / path.name).symlink_to(path)
    before = os.environ.get("MINISGL_CACHE_DIR")
    os.environ["MINISGL_CACHE_DIR"] = str(where)
    try:
        yield where
    finally:
        if before is None:
            del os.environ["MINISGL_CACHE_DIR"]
        else:
            os.environ["MINISGL_CACHE_DIR"] = before
