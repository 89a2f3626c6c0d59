"""Build the CPU kernels (layers/csrc/*.c) for the instruction set of the running machine.

No build step for users: the first use compiles the sources with the system C compiler into a
per-user cache (one shared library per instruction set and source digest) and later runs load
that file. Two builds exist:
- "avx2": AVX2 + FMA, every kernel;
- "avx512": the same kernels compiled for AVX-512 plus an AVX-512 GEMV (gemv_avx512.c), with
  native bf16 dot products where the CPU has AVX512-BF16 (there the panel matmul is
  panel512.c's, on VDPBF16PS's layout, instead of panel.c's), the quantized GEMV's integer dot
  products in one instruction where it has AVX512-VNNI (and there qvnni.c: many rows of 8-bit
  x against integer codes), and AMX tile kernels (csrc/amx.h)
  where it has AMX-TILE, AMX-BF16 and AMX-INT8.
The build is chosen from the CPU's flags at load time; MINISGL_CPU_ISA=avx2 forces the AVX2
build on an AVX-512 machine (to compare them). Torch-free.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

from minisgl.cache import cache_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
COMMON_SOURCES = (
    "gemv.c",
    "gemm.c",
    "panel.c",
    "attention.c",
    "elementwise.c",
    "rows.c",
    "stream.c",
    "qgemv.c",
    "qdequant.c",
    "qmins.c",
    "qamx.c",
    "qamxi.c",
    "qamxf.c",
    "amx.c",
    "chain.c",
    "moe.c",
)
AVX512_NEEDS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})
AMX_NEEDS = frozenset({"amx_tile", "amx_bf16", "amx_int8"})


@cache
def cpu_info() -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo; ("", {}) where there is none."""
    model, flags = "", frozenset[str]()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return model or platform.processor() or platform.machine(), flags


def pick_isa(flags: frozenset[str], forced: str | None = None) -> str | None:
    """The build for a CPU with these flags: "avx512", "avx2" or None (no kernels)."""
    has_avx2 = {"avx2", "fma"} <= flags
    if forced == "avx2":
        return "avx2" if has_avx2 else None
    if flags >= AVX512_NEEDS:
        return "avx512"
    return "avx2" if has_avx2 else None


def compile_flags(isa: str, flags: frozenset[str]) -> list[str]:
    out = ["-mavx2", "-mfma", "-mf16c"]
    if isa == "avx512":
        out += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
        if "avx512_bf16" in flags:
            out.append("-mavx512bf16")
        if "avx512_vnni" in flags:  # the quantized GEMV's int16 dot products (qgemv.c)
            out.append("-mavx512vnni")
        if "avx512vbmi" in flags:  # byte lookups: fp8 codes to bf16 (qvpanel.c)
            out.append("-mavx512vbmi")
        # AMX tiles (csrc/amx.h): bf16 and int8 tile dot products where the CPU has them all.
        if flags >= AMX_NEEDS:
            out += ["-mamx-tile", "-mamx-bf16", "-mamx-int8"]
    return out


def extensions(isa: str, flags: frozenset[str]) -> list[str]:
    """The optional instruction sets the `isa` build uses on a CPU with these flags (its
    compiler flags past the build's own, without "-m"): what the start-up log names."""
    base = compile_flags(isa, frozenset())
    return [f.removeprefix("-m") for f in compile_flags(isa, flags) if f not in base]


def sources(isa: str) -> list[Path]:
    wide = ["gemv_avx512.c", "panel512.c", "qvnni.c", "qvpanel.c"] if isa == "avx512" else []
    names = list(COMMON_SOURCES) + wide
    return [CSRC / n for n in names]


def source_digest(isa: str, cflags: list[str], cc: str = "") -> str:
    # The sources compiled, not only their contents: a file added to the list is a new build.
    h = hashlib.sha256(" ".join([isa, cc, *cflags, *(p.name for p in sources(isa))]).encode())
    for p in sorted(CSRC.glob("*.[ch]")):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()[:16]


def build(isa: str, flags: frozenset[str]) -> Path | None:
    """The shared library for `isa`, compiled now if the cache has none; None if it cannot be."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    cflags = compile_flags(isa, flags)
    out = cache_dir() / "kernels" / f"cpu-kernels-{isa}-{source_digest(isa, cflags, cc)}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        lib = Path(tmp) / "kernels.so"
        error = _compile(cc, cflags, sources(isa), Path(tmp), lib)
        if error is not None:
            logger.warning("CPU kernels (%s) not built with %s: %s", isa, cc, error[-800:])
            return None
        os.replace(lib, out)  # atomic: concurrent builders (TP ranks) agree on one file
    logger.info(
        "CPU kernels (%s) compiled in %.1f s, cached in %s", isa, time.perf_counter() - t0, out
    )
    return out


def _compile(
    cc: str, cflags: list[str], srcs: list[Path], tmp: Path, lib: Path, opt: str = "-O3"
) -> str | None:
    """Each source to an object file, as many at once as there are CPUs (the first start of
    a machine waits for this), then one shared library; the compiler's error text, if any."""
    base = [cc, opt, *cflags, "-fopenmp", "-fPIC", f"-I{CSRC}", "-c"]
    objects = [tmp / f"{src.stem}.o" for src in srcs]
    jobs = [[*base, str(src), "-o", str(obj)] for src, obj in zip(srcs, objects)]
    jobs.append([cc, "-shared", "-fopenmp", *map(str, objects), "-o", str(lib), "-lm"])

    def run(cmd: list[str]) -> str | None:
        result = subprocess.run(cmd, capture_output=True, text=True)
        return result.stderr if result.returncode != 0 else None

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        errors = [e for e in pool.map(run, jobs[:-1]) if e is not None]
    return "\n".join(errors) if errors else run(jobs[-1])
