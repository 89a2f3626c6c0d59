"""Which build of the CPU kernels a CPU gets, and that each build this CPU can run compiles
from the packaged sources into the cache and exports its kernels."""

from __future__ import annotations

import ctypes
import logging
import shutil
from pathlib import Path

import pytest

from minisgl.layers import cpu_build, cpu_kernels

AVX2 = frozenset({"avx2", "fma", "sse4_2"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


def test_isa_follows_the_cpu_flags() -> None:
    assert cpu_build.pick_isa(frozenset({"sse4_2"})) is None
    assert cpu_build.pick_isa(AVX2) == "avx2"
    assert cpu_build.pick_isa(AVX512) == "avx512"
    assert cpu_build.pick_isa(AVX512, forced="avx2") == "avx2"
    # AVX-512 F without BW/VL (Xeon Phi style) is not enough for the AVX-512 build.
    assert cpu_build.pick_isa(AVX2 | {"avx512f"}) == "avx2"


def test_native_bf16_dot_products_only_where_the_cpu_has_them() -> None:
    assert "-mavx512bf16" not in cpu_build.compile_flags("avx512", AVX512)
    assert "-mavx512bf16" in cpu_build.compile_flags("avx512", AVX512 | {"avx512_bf16"})
    assert "-mavx512f" not in cpu_build.compile_flags("avx2", AVX512)
    names = [p.name for p in cpu_build.sources("avx512")]
    assert "gemv_avx512.c" in names and "gemv_avx512.c" not in [
        p.name for p in cpu_build.sources("avx2")
    ]
    assert all(p.is_file() for p in cpu_build.sources("avx512"))


def test_amx_tiles_only_where_the_cpu_has_all_three() -> None:
    amx = AVX512 | {"amx_tile", "amx_bf16", "amx_int8"}
    flags = cpu_build.compile_flags("avx512", amx)
    assert {"-mamx-tile", "-mamx-bf16", "-mamx-int8"} <= set(flags)
    assert "-mamx-tile" not in cpu_build.compile_flags("avx512", amx - {"amx_int8"})
    assert "-mamx-tile" not in cpu_build.compile_flags("avx2", amx)


def test_every_build_this_cpu_runs_compiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path))
    _, flags = cpu_build.cpu_info()
    isas = {cpu_build.pick_isa(flags, "avx2"), cpu_build.pick_isa(flags)} - {None}
    for isa in isas:
        path = cpu_build.build(isa, flags)
        assert path is not None and path.parent == tmp_path / "kernels" and isa in path.name
        lib = ctypes.CDLL(str(path))
        assert lib.gemv_bf16 and lib.decode_attn_bf16 and lib.stream_read
        assert hasattr(lib, "gemv512_bf16") == (isa == "avx512")
        assert cpu_build.build(isa, flags) == path  # cached: the same file, no rebuild


# The AVX-512 flag sets of the server CPUs the build meets (as /proc/cpuinfo names them).
VNNI_VBMI = AVX512 | {"avx512_vnni", "avx512vbmi"}
SERVER_CPUS = {
    "Skylake-SP": AVX512,
    "Cascade Lake": AVX512 | {"avx512_vnni"},
    "Cooper Lake": AVX512 | {"avx512_vnni", "avx512_bf16"},
    "Ice Lake (and VMs that hide AVX512-BF16 and AMX)": VNNI_VBMI,
    "Zen 4": VNNI_VBMI | {"avx512_bf16"},
    "Sapphire Rapids": VNNI_VBMI | {"avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"},
}


@pytest.mark.parametrize("cpu", SERVER_CPUS)
def test_the_avx512_build_compiles_for_every_server_cpu(cpu: str, tmp_path: Path) -> None:
    """Not only for the CPU at hand: a source that needs a flag the CPU lacks fails the whole
    AVX-512 build there, and that CPU silently runs the AVX2 build (qvnni.c's bf16 stores
    needed AVX512-BF16 on VNNI CPUs without it). -O0: the same errors, a quarter the time."""
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None
    cflags = cpu_build.compile_flags("avx512", SERVER_CPUS[cpu])
    error = cpu_build._compile(
        cc, cflags, cpu_build.sources("avx512"), tmp_path, tmp_path / "k.so", opt="-O0"
    )
    assert error is None, error[-2000:]


def test_the_log_names_the_build_and_its_extensions() -> None:
    """What start-up logs beside the build: the optional instruction sets it was compiled
    with, so that a CPU running less than it has shows it."""
    assert cpu_build.extensions("avx2", SERVER_CPUS["Sapphire Rapids"]) == []
    assert cpu_build.extensions("avx512", SERVER_CPUS["Skylake-SP"]) == []
    assert cpu_build.extensions(
        "avx512", SERVER_CPUS["Ice Lake (and VMs that hide AVX512-BF16 and AMX)"]
    ) == ["avx512vnni", "avx512vbmi"]
    amx = cpu_build.extensions("avx512", SERVER_CPUS["Sapphire Rapids"])
    assert {"avx512bf16", "amx-tile", "amx-bf16", "amx-int8"} <= set(amx)


def test_a_failed_avx512_build_says_so_and_runs_the_avx2_one(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the AVX-512 build does not compile, the AVX2 build runs and a warning says so
    (it ran silently: on a CPU whose flags broke one source, every kernel at half the vector
    width without a word); the log names the build that runs."""
    _, flags = cpu_build.cpu_info()
    if cpu_build.pick_isa(flags, "avx2") is None:
        pytest.skip("no AVX2 on this CPU")
    real = cpu_build.build
    monkeypatch.setattr(
        cpu_build, "build", lambda isa, f: None if isa == "avx512" else real(isa, f)
    )
    monkeypatch.setattr(cpu_kernels, "_isa", lambda: "avx512")
    for name, value in (("_TRIED", False), ("_LIB", None), ("_LIB_PATH", None)):
        monkeypatch.setattr(cpu_kernels, name, value)
    monkeypatch.setattr(cpu_kernels, "_SPLIT_POINTS", {})  # the loaded build's stay as they are
    with caplog.at_level(logging.INFO, logger="minisgl.layers.cpu_kernels"):
        assert cpu_kernels.load() is not None
    assert cpu_kernels.isa() == "avx2"
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert (logging.WARNING, "CPU kernels: the AVX-512 build failed, the AVX2 build runs") in said
    assert (logging.INFO, "CPU kernels: the avx2 build") in said


def test_a_compiler_that_fails_means_no_kernels_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the sources do not compile (a broken or foreign `cc`), the build is None (the
    PyTorch paths run) and nothing half-built is left in the cache."""
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    assert cpu_build.build("avx2", AVX2) is None
    assert list((tmp_path / "kernels").iterdir()) == []
