"""Kernel builds for CPUs other than this one, for tests that code compiles everywhere."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

from minisgl.layers import cpu_build


def without_amx(source: str, isa: str, tmp: Path) -> ctypes.CDLL | None:
    """csrc/`source` alone, built as `isa` for this CPU's flags less AMX, loaded; None where
    there is no C compiler. Raises with the compiler's text where it does not compile."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    _, flags = cpu_build.cpu_info()
    lib = tmp / f"{Path(source).stem}-{isa}.so"
    cflags = cpu_build.compile_flags(isa, flags - cpu_build.AMX_NEEDS)
    error = cpu_build._compile(cc, cflags, [cpu_build.CSRC / source], tmp, lib)
    if error is not None:
        raise RuntimeError(error)
    return ctypes.CDLL(str(lib))
