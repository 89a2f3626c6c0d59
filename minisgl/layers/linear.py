"""Tensor-parallel linear layers (Megatron style) with fused projections.

Column-parallel layers split the output features across ranks and need no communication;
row-parallel layers split the input features and sum the partial products with an all-reduce.
A column-parallel layer feeding a row-parallel one (qkv -> o, gate_up -> down) costs one
all-reduce per pair. Each layer knows how to cut its own rank's shard out of a full Hugging Face
tensor (`load`), so loading never materialises another rank's weights on the device.

A fused layer whose projections a checkpoint stores in different formats (a GGUF Q4_K_M file's
Q4_K q/k beside a Q6_K v, a mixed-precision checkpoint's 8-bit k_proj) holds its weight in
parts, a run of projections of one format each (`split`), and concatenates their products.

With tp_size == 1 no collective is ever called.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl import distributed
from minisgl.layers.cpu_linear import CpuLinearKernel
from minisgl.quant.weight import QuantWeight


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({d})")
    return n // d


class LinearBase(nn.Module):
    """y = x @ W.T (+ b) over this rank's weight shard [out_local, in_local]; the bias (Qwen2's
    q/k/v, `attention_bias` models) is added by the subclass where its rank owns it."""

    def __init__(
        self, in_local: int, out_local: int, tp_rank: int, tp_size: int, bias: bool = False
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = nn.Parameter(torch.empty(out_local, in_local), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False) if bias else None
        # Set on CPU by cpu_linear.prepack_modules: the fastest matmul per row count.
        self.kernel: CpuLinearKernel | None = None
        self.kernel_out_dtype: torch.dtype | None = None
        # The weight's row ranges as layers of their own (`split`); None: one weight.
        self.parts: nn.ModuleList | None = None

    @property
    def out_features(self) -> int:
        """This rank's output features (the parts' together where the weight is split)."""
        if self.parts is not None:
            return sum(p.out_features for p in self.part_list())
        return self.weight.shape[0]

    def projection_rows(self) -> list[int]:
        """Each logical projection's local output rows, in order (one: an unfused layer)."""
        return [self.out_features]

    def part_list(self) -> list[LinearBase]:
        """The parts `split` made, in order (none: one weight)."""
        return [p for p in self.parts or () if isinstance(p, LinearBase)]

    def split(self, rows: list[int]) -> list[LinearBase]:
        """Hold the weight as parts of `rows` output rows each, in order (each a LinearBase of
        its own, whose weight the quantized loader may swap for its format's); `weight`
        becomes None and the output the parts' concatenated."""
        n, k = self.weight.shape
        assert sum(rows) == n and len(rows) > 1, (rows, n)
        like = self.weight
        with torch.device(like.device):  # meta before the model is materialised: no memory
            parts = [LinearBase(k, r, self.tp_rank, self.tp_size) for r in rows]
        for part in parts:  # the weight's dtype
            part.weight = nn.Parameter(like.new_empty(part.weight.shape), requires_grad=False)
        del self.weight
        self.register_parameter("weight", None)
        self.parts = nn.ModuleList(parts)
        return parts

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.parts is not None:
            return torch.cat([p.matmul(x) for p in self.part_list()], dim=-1)
        if self.kernel is not None:
            return self.kernel(x)
        if isinstance(self.weight, QuantWeight):  # quantized (minisgl/quant/)
            return self.weight.matmul(x)
        return F.linear(x, self.weight)

    def matmul_bias(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        return y if self.bias is None else y.add_(self.bias)

    def _target(self, full: torch.Tensor, offset: int, n: int) -> torch.Tensor:
        """Rows [offset, offset + n) of the local tensor a full HF tensor fills: the weight
        (the part holding them where it is split), or the bias for a 1-D one."""
        if full.dim() == 1:
            assert self.bias is not None, "a bias for a layer built without one"
            return self.bias.data.narrow(0, offset, n)
        for part in self.part_list():
            if offset < part.out_features:
                assert offset + n <= part.out_features, "a projection across two parts"
                return part.weight.data.narrow(0, offset, n)
            offset -= part.out_features
        return self.weight.data.narrow(0, offset, n)


class ColumnParallelLinear(LinearBase):
    """Several logical projections of the same input fused into one matmul (e.g. gate and up);
    each is split across ranks on its own, so rank r holds [gate_r; up_r]."""

    def __init__(
        self, in_features: int, out_features: list[int], tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        self.out_local = [_divide(o, tp_size, "output features") for o in out_features]
        super().__init__(in_features, sum(self.out_local), tp_rank, tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)

    def projection_rows(self) -> list[int]:
        return list(self.out_local)

    def load(self, full: torch.Tensor, shard: int = 0) -> None:
        """Copy this rank's rows of logical projection `shard` from the full HF tensor."""
        n = self.out_local[shard]
        offset = sum(self.out_local[:shard])
        src = full.narrow(0, self.tp_rank * n, n)
        self._target(full, offset, n).copy_(src)


class QKVParallelLinear(LinearBase):
    """q, k and v projections in one matmul. Query heads are split across ranks; KV heads too
    when there are at least as many as ranks, otherwise each KV head is replicated on the ranks
    whose query heads use it."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        bias: bool = False,
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp_size, "num_attention_heads")
        if num_kv_heads >= tp_size:
            self.num_kv_heads = _divide(num_kv_heads, tp_size, "num_key_value_heads")
            self.kv_head_start = tp_rank * self.num_kv_heads
        else:
            _divide(tp_size, num_kv_heads, "tensor-parallel size over num_key_value_heads")
            self.num_kv_heads = 1
            self.kv_head_start = tp_rank // (tp_size // num_kv_heads)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, tp_rank, tp_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul_bias(x)

    def projection_rows(self) -> list[int]:
        return [self.q_size, self.kv_size, self.kv_size]

    def load(self, full: torch.Tensor, shard: str) -> None:
        if shard == "q":
            src = full.narrow(0, self.tp_rank * self.q_size, self.q_size)
            offset = 0
        else:
            src = full.narrow(0, self.kv_head_start * self.head_dim, self.kv_size)
            offset = self.q_size + (self.kv_size if shard == "v" else 0)
        self._target(full, offset, src.shape[0]).copy_(src)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial outputs are summed over ranks."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        bias: bool = False,
    ) -> None:
        self.in_local = _divide(in_features, tp_size, "input features")
        super().__init__(self.in_local, out_features, tp_rank, tp_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        if self.tp_size > 1:
            distributed.all_reduce(y)
        # After the sum: the bias is added once, not once per rank.
        return y if self.bias is None else y.add_(self.bias)

    def load(self, full: torch.Tensor) -> None:
        if full.dim() == 1:
            self._target(full, 0, full.shape[0]).copy_(full)
            return
        src = full.narrow(1, self.tp_rank * self.in_local, self.in_local)
        self.weight.data.copy_(src)
