"""A 1-row decode step's Python between its matmuls runs on caches the matmuls streamed out, so
each lookup and torch op there costs several times its warm price: the per-step path reads
submodules as plain attributes and checks a quantized weight for the C kernels once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from minisgl.layers import cpu_kernels
from minisgl.models.config import ModelConfig
from minisgl.models.loader import load_model
from minisgl.models.qwen3 import plain_submodules
from minisgl.quant import cpu_gemv
from minisgl.quant.qtensor import QTensor, dequantize
from minisgl.quant.quantize import quantize
from minisgl.quant.scheme import load_scheme
from minisgl.quant.weight import QuantWeight
from minisgl.testing.fixture import write_fixture_model


def _int8_weight(n: int, k: int) -> QuantWeight:
    q = quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(0)), load_scheme("int8"))
    w = QuantWeight(n, k, bits=8, fp8=False, group_size=0, groups=1, scattered_groups=False)
    w.copy_(q)
    return w


def test_a_quantized_matmul_checks_its_weight_once(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _int8_weight(64, 128)
    checks: list[int] = []
    monkeypatch.setattr(cpu_gemv, "usable", lambda x, q: checks.append(1) or True)

    def reference(x: torch.Tensor, q: QTensor) -> torch.Tensor:
        return x @ dequantize(q, x.dtype).T

    w.kernel = reference
    x = torch.randn(1, 128)
    for _ in range(3):
        y = w.matmul(x)
    assert len(checks) == 1
    torch.testing.assert_close(y, reference(x, w.view()))
    assert w.whole() is w.whole()
    # New buffers (a device move, a GPU repacking): a new view, checked again.
    w.codes = w.codes.clone()
    assert w.whole().codes is w.codes
    w.matmul(x)
    assert len(checks) == 2


def test_plain_submodules_never_go_stale() -> None:
    m = nn.Module()
    m.a = nn.Linear(2, 2)
    plain_submodules(m)
    assert vars(m)["a"] is m._modules["a"]
    m.a = nn.Linear(3, 3)  # nn.Module.__setattr__ drops the plain copy
    assert m.a is m._modules["a"] and m.a.in_features == 3


def test_a_loaded_model_reads_its_submodules_as_plain_attributes(tmp_path: Path) -> None:
    path = write_fixture_model(tmp_path / "m", preset="tiny", dtype="float32")
    config = ModelConfig.from_dir(path)
    model = load_model(path, config, torch.float32, torch.device("cpu"), prepack=False)
    layer = model.model.layers[0]
    for m in (model, model.model, layer, layer.self_attn, layer.mlp):
        assert m._modules and all(vars(m)[k] is v for k, v in m._modules.items())


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_a_few_ids_are_looked_up_by_the_c_dequantizer(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    n, k = 300, 256
    q = quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(1)), load_scheme(method))
    w = QuantWeight(
        n,
        k,
        bits=q.bits,
        fp8=q.zeros is None,
        group_size=q.group_size,
        groups=q.scales.shape[1],
        scattered_groups=False,
    )
    w.copy_(q)
    calls: list[int] = []
    real = cpu_gemv.dequant_rows
    monkeypatch.setattr(cpu_gemv, "dequant_rows", lambda *a: calls.append(1) or real(*a))
    for ids in (torch.tensor([7]), torch.tensor([[299, 0, 7]]), torch.arange(40) * 7):
        expect = dequantize(q, torch.bfloat16)[ids.reshape(-1)].view(*ids.shape, k)
        assert torch.equal(w.rows(ids, torch.bfloat16), expect)
    # The C kernels (where they load here) took the two decode-sized lookups, row by row.
    assert len(calls) == (4 if cpu_kernels.load() is not None else 0)
