"""The CPU's fused elementwise kernels (csrc/elementwise.c) against the torch ops they replace:
residual add + RMSNorm, per-head RMSNorm + rotary, SiLU x up, and the KV cache's row store.

Inputs with small integer values make every sum of squares exact in any order, so the norms
must then equal torch's result bit for bit: that checks each rounding point (the model dtype's
rounding after every torch op). Rows: odd counts, vector bodies with and without tails, one
thread and the rows split over two; both the build this machine loads and the AVX2 build
(compiled here from the same source) where they differ."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from minisgl.kvcache.kv_pool import KVPool
from minisgl.layers import cpu_build, cpu_kernels
from minisgl.layers.norm import rms_normalize
from minisgl.layers.rotary import RotaryEmbedding, apply_rotary

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no CPU kernels here")

NEVER = 2**63 - 1
DTYPES = [torch.bfloat16, torch.float32]


class Kernels:
    """elementwise.c's entry points in one shared library, called the way cpu_kernels does."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self.lib = lib
        for name in ("rmsnorm_bf16", "rmsnorm_f32"):
            fn = getattr(lib, name)
            fn.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, i64, i64, ctypes.c_float]
            fn.argtypes += [ptr, ptr]
            fn.restype = None
        for name in ("silu_mul_bf16", "silu_mul_f32"):
            getattr(lib, name).argtypes = [ptr, ptr, i64, i64]
            getattr(lib, name).restype = None
        self.norm_min = ctypes.c_int64.in_dll(lib, "norm_parallel_min")
        self.silu_min = ctypes.c_int64.in_dll(lib, "silu_parallel_min")

    def norm(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        res: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, D] or [T, H, D] (heads packed, any token stride); w [D] or [H, D]."""
        d = x.shape[-1]
        group = x.shape[1] if x.dim() == 3 else 1
        out = torch.empty(*x.shape, dtype=x.dtype)
        summed = torch.empty_like(out) if res is not None else None
        cos, sin = rope if rope is not None else (None, None)
        fn = self.lib.rmsnorm_bf16 if x.dtype == torch.bfloat16 else self.lib.rmsnorm_f32
        fn(
            x.data_ptr(),
            group,
            x.stride(0),
            res.data_ptr() if res is not None else None,
            summed.data_ptr() if summed is not None else None,
            w.data_ptr(),
            w.numel() // d,
            out.data_ptr(),
            x.numel() // d,
            d,
            1e-6,
            cos.data_ptr() if cos is not None else None,
            sin.data_ptr() if sin is not None else None,
        )
        return out, summed

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
        fn = self.lib.silu_mul_bf16 if x.dtype == torch.bfloat16 else self.lib.silu_mul_f32
        fn(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1] // 2)
        return out


def _loaded() -> Kernels:
    lib = cpu_kernels.load()
    assert lib is not None and cpu_kernels._LIB_PATH is not None
    return Kernels(ctypes.CDLL(str(cpu_kernels._LIB_PATH)))


@pytest.fixture(scope="module")
def avx2_build(tmp_path_factory: pytest.TempPathFactory) -> Kernels | None:
    """elementwise.c compiled as the AVX2 build, where the loaded build is another one."""
    if cpu_kernels.isa() == "avx2":
        return None
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None
    path = tmp_path_factory.mktemp("avx2") / "elementwise.so"
    src = cpu_build.CSRC / "elementwise.c"
    flags = cpu_build.compile_flags("avx2", cpu_build.cpu_info()[1])
    cmd = [cc, "-O2", *flags, "-fopenmp", "-fPIC", "-shared", f"-I{cpu_build.CSRC}", str(src)]
    subprocess.run([*cmd, "-o", str(path), "-lm"], check=True, capture_output=True)
    return Kernels(ctypes.CDLL(str(path)))


@pytest.fixture(scope="module", params=["loaded", "avx2"])
def kernels(request: pytest.FixtureRequest, avx2_build: Kernels | None) -> Kernels:
    if request.param == "loaded":
        return _loaded()
    if avx2_build is None:
        pytest.skip("the loaded build is the AVX2 one")
    return avx2_build


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest, kernels: Kernels) -> Iterator[int]:
    """1: every call on one thread; 2: rows split over two threads whatever their count."""
    saved = torch.get_num_threads(), kernels.norm_min.value, kernels.silu_min.value
    torch.set_num_threads(request.param)
    kernels.norm_min.value = kernels.silu_min.value = 0 if request.param > 1 else NEVER
    yield request.param
    torch.set_num_threads(saved[0])
    kernels.norm_min.value, kernels.silu_min.value = saved[1], saved[2]


def _ints(*shape: int, dtype: torch.dtype, high: int = 8) -> torch.Tensor:
    return torch.randint(-high, high + 1, shape).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1024, 48, 44])  # pairs of vectors only; + one vector; + a tail
@pytest.mark.parametrize("rows", [1, 37])
def test_add_norm_equals_torch_bit_for_bit(
    kernels: Kernels, threads: int, dtype: torch.dtype, d: int, rows: int
) -> None:
    torch.manual_seed(d + rows)
    x, res = _ints(rows, d, dtype=dtype), _ints(rows, d, dtype=dtype)
    w = torch.randn(d).to(dtype)
    out, summed = kernels.norm(x, w, res)
    want_sum = x + res
    assert summed is not None and torch.equal(summed, want_sum)
    assert torch.equal(out, w * rms_normalize(want_sum, 1e-6))
    plain, _ = kernels.norm(x, w)
    assert torch.equal(plain, w * rms_normalize(x, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [128, 64, 80, 36])  # half-rows: pairs; one pair; + one vector; tail
def test_head_norm_rotary_equals_torch_bit_for_bit(
    kernels: Kernels, threads: int, dtype: torch.dtype, d: int
) -> None:
    torch.manual_seed(d)
    t, hq, hkv = 13, 5, 2
    qkv = _ints(t, (hq + 2 * hkv) * d, dtype=dtype)
    qk = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)  # token stride > heads: as the model
    w = torch.randn(hq + hkv, d).to(dtype)
    cos, sin = RotaryEmbedding(d, 1e6, None, 64).cos_sin(torch.arange(7, 7 + t), dtype)
    got, _ = kernels.norm(qk, w, rope=(cos.contiguous(), sin.contiguous()))
    want = apply_rotary(rms_normalize(qk, 1e-6) * w, cos, sin)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_of_random_rows_tracks_torch(
    kernels: Kernels, threads: int, dtype: torch.dtype
) -> None:
    """Real-valued rows: the sum of squares' order may move a bf16 result by one step, rarely."""
    torch.manual_seed(1)
    x, res, w = (
        (torch.randn(37, 1024) * 3).to(dtype),
        torch.randn(37, 1024).to(dtype),
        torch.randn(1024).to(dtype),
    )
    out, summed = kernels.norm(x, w, res)
    assert summed is not None and torch.equal(summed, x + res)
    want = w * rms_normalize(x + res, 1e-6)
    if dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    else:
        assert (out != want).float().mean() < 0.01
        torch.testing.assert_close(out.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("i", [3072, 40, 44])  # pairs only; + one vector; + a tail
def test_silu_mul_tracks_torch(kernels: Kernels, threads: int, dtype: torch.dtype, i: int) -> None:
    torch.manual_seed(i)
    x = (torch.randn(9, 2 * i) * 4).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated exp, both signs
    gate, up = x.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = kernels.silu_mul(x)
    if dtype == torch.float32:  # the exp may differ from torch's in its last bit
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # same roundings: the exp's last bit rarely moves a bf16 result by one step
        assert (got != want).float().mean() < 0.01
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_gives_the_same_bits_in_both_builds(
    avx2_build: Kernels | None, dtype: torch.dtype
) -> None:
    """The 16-lane exp is the 8-lane one's arithmetic: an AVX-512 machine and an AVX2 one agree."""
    if avx2_build is None:
        pytest.skip("the loaded build is the AVX2 one")
    torch.manual_seed(2)
    x = (torch.randn(5, 2 * 3072) * 6).to(dtype)
    assert torch.equal(_loaded().silu_mul(x), avx2_build.silu_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 67])  # one row; rows enough to split over the threads
def test_kv_store_writes_what_index_copy_writes(dtype: torch.dtype, t: int) -> None:
    torch.manual_seed(t)
    pool = KVPool(2, 16, 16, 4, 256, dtype, "cpu")
    qkv = torch.randn(t, 12 * 256).to(dtype)
    k = qkv[:, 4 * 256 : 8 * 256].view(t, 4, 256)  # views of the fused output, as the model
    v = qkv[:, 8 * 256 :].view(t, 4, 256)
    slots = torch.randperm(256)[:t]
    want_k, want_v = pool.k_buffers[1].clone(), pool.v_buffers[1].clone()
    want_k.index_copy_(0, slots, k)
    want_v.index_copy_(0, slots, v)
    assert cpu_kernels.kv_store_supported(pool.k_buffers[1], k, v)
    pool.store(1, slots, k, v)
    assert torch.equal(pool.k_buffers[1], want_k) and torch.equal(pool.v_buffers[1], want_v)
    assert not pool.k_buffers[0].any()  # the other layer untouched


@pytest.mark.parametrize("cache", [None, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_kv_store_refuses_a_slot_outside_the_pool_and_stores_nothing(cache) -> None:  # noqa: ANN001
    pool = KVPool(1, 2, 16, 2, 64, torch.bfloat16, "cpu", cache_dtype=cache)
    k, v = torch.ones(3, 2, 64).bfloat16(), torch.ones(3, 2, 64).bfloat16()
    assert cpu_kernels.kv_store_supported(pool.k_buffers[0], k, v)
    with pytest.raises(IndexError):
        pool.store(0, torch.tensor([0, 5, 32]), k, v)
    held = (b.view(torch.uint8) for b in (pool.k_buffers[0], pool.v_buffers[0]))
    assert not any(b.any() for b in held)


def test_kv_store_falls_back_to_index_copy_for_rows_it_cannot_take() -> None:
    """Rows whose heads are not packed (here: head-major storage): torch's index_copy_."""
    pool = KVPool(1, 2, 16, 2, 64, torch.bfloat16, "cpu")
    k = torch.randn(2, 3, 64).bfloat16().transpose(0, 1)
    v = torch.randn(2, 3, 64).bfloat16().transpose(0, 1)
    assert not cpu_kernels.kv_store_supported(pool.k_buffers[0], k, v)
    slots = torch.tensor([4, 0, 31])
    pool.store(0, slots, k, v)
    assert torch.equal(pool.k_buffers[0][slots], k) and torch.equal(pool.v_buffers[0][slots], v)
