"""A CPU decode step's decoder layers as one C call (csrc/chain.c).

At a few rows a step is ~10 kernel calls a layer, each with a few microseconds of Python around
it (ctypes argument conversion, an output tensor, the module frames): on a 2-core Zen 3 about
a fifth of a B=1 Qwen3-0.6B step. A `Chain` holds, for one batch size, every call of every
layer with its arguments bound: the weights and each one's kernel pick for that row count, the
norms' weights, the KV pool's buffers, and its own activation buffers, reused each step. A
step then fills the few values that change (the input rows, the KV slots, the rotary tables)
and makes one call. The kernels and their arguments are those of the unfused path, so the
outputs are the same bits.

Around the layers, where the model has them as C calls: a quantized embedding table's lookup
of the step's token ids (the first op), the rotary rows of the step's positions (`rope`: read
from the model's tables, not gathered by torch each step) and the final norm and the LM head,
float or quantized, into the step's float32 logits (the last ops).

The model (qwen3.py) lays out the layers with `Chain`'s emitters; whatever it cannot express
(another kernel pick, a bias, tensor parallelism, a step of more than MAX_ROWS rows or whose
attention is not one decode-kernel row per new token) leaves the unfused path to run.
MINISGL_CPU_DECODE_CHAIN=0: never.
"""

from __future__ import annotations

import ctypes
import os
import struct
from typing import Any

import torch

from minisgl.layers import cpu_kernels, cpu_linear, kernel_choice, moe
from minisgl.layers.cpu_linear import CpuLinearKernel
from minisgl.quant import cpu_choice, cpu_gemv
from minisgl.quant.weight import QuantWeight

# As csrc/chain.c.
OP_WORDS = 24
(
    OP_NORM, OP_ATTN, OP_SILU, OP_MM8, OP_MM7, OP_QMM, OP_ROWS, OP_ROPE, OP_ROUTE, OP_MOE, OP_PROWS,
    OP_MMI, OP_MINS,
) = range(13)  # fmt: skip
STEP_X, STEP_SLOTS, STEP_LENS, STEP_KMAX, STEP_NEW_SLOTS, STEP_COS, STEP_SIN, STEP_OUT = range(8)
STEP_IDS, STEP_POS = 8, 9
STEP_WORDS = 10
FROM_STEP_X, FROM_STEP_OUT = -1, -2
# The most rows a chain is built for: steps up to the chooser's 33-64 bucket, whose picks are
# still the panels on many CPUs; past it a step's Python is a small share of its time. In the
# chain a B=32 Qwen3-0.6B bf16 step ran 1.04x faster than layer by layer (AMD EPYC Zen 4).
MAX_ROWS = 64

# Where a step's time goes, op by op (benchmarks/decode_step.py --breakdown): while a dict,
# each `Chain.run` times its ops (csrc/chain.c's decode_chain_timed) and adds their seconds
# under each op's label ("C norms", "C matmul 6144x1024 panel", ...); None: the plain call.
timing: dict[str, float] | None = None
timing_cpu_clock = False  # the process's CPU time instead of the wall clock


class Unsupported(Exception):
    """A call the chain does not express: the unfused path runs."""


def enabled() -> bool:
    return os.environ.get("MINISGL_CPU_DECODE_CHAIN", "1") not in ("0", "false", "no")


def available(dtype: torch.dtype) -> bool:
    lib = cpu_kernels.load()
    return (
        enabled()
        and lib is not None
        and lib.decode_chain is not None
        and dtype in (torch.bfloat16, torch.float32)
    )


def _address(fn: Any) -> int:
    addr = ctypes.cast(fn, ctypes.c_void_p).value
    assert addr is not None
    return addr


def _float_bits(v: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", v))[0])


class Chain:
    """One batch size's calls (see the module doc). Emitters take tensors or FROM_STEP_X for
    the step's input rows; they raise Unsupported for what the chain cannot run."""

    def __init__(
        self,
        rows: int,
        dtype: torch.dtype,
        backend: Any,
        arena: dict[tuple[Any, ...], torch.Tensor],
    ) -> None:
        """`arena`: buffers of MAX_ROWS rows by dtype, name and shape, shared by every chain
        given it (each takes its first rows): one step runs at a time, and a chain per batch
        size with buffers of its own would hold the sum of their rows (2080 rows' worth for
        1..64)."""
        lib = cpu_kernels.load()
        assert lib is not None
        assert 0 < rows <= MAX_ROWS
        self.lib, self.rows, self.dtype = lib, rows, dtype
        self._arena = arena
        self.backend = backend  # the attention backend whose KV pool the ops write
        self.bf16 = int(dtype == torch.bfloat16)
        self._ops: list[list[int]] = []
        self._labels: list[str] = []  # what each op is, for `timing`
        # Every tensor an op points at, kept alive as long as the chain.
        self._held: list[Any] = []
        self._buffers: dict[tuple[torch.dtype, str, tuple[int, ...]], torch.Tensor] = {}
        self.step = (ctypes.c_int64 * STEP_WORDS)()
        # The buffer the first op (`embedding`) looks the step's token ids' rows up into, the
        # layers' input; None: the step's input rows come from the caller.
        self.embedded: torch.Tensor | None = None
        # Where the decoder layers' ops end (the model's mark; the final norm and the LM head
        # may follow): a step that wants the hidden states runs only these.
        self.layers_end: int | None = None
        self.ops = torch.empty(0, OP_WORDS, dtype=torch.int64)
        # The step's rotary rows (`rope`), which the norms' rotation reads.
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    def buffer(self, name: str, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[rows, *shape] in the chain's dtype (or `dtype`): one per name, shape and dtype
        (layers reuse them), the first rows of the arena's."""
        dtype = dtype or self.dtype
        key = (dtype, name, shape)
        t = self._buffers.get(key)
        if t is None:
            whole = self._arena.get(key)
            if whole is None:
                whole = self._arena[key] = torch.empty(MAX_ROWS, *shape, dtype=dtype)
            t = self._buffers[key] = whole[: self.rows]
        return t

    def _emit(self, kind: int, fn: Any, *args: int, label: str = "") -> None:
        assert len(args) <= OP_WORDS - 2
        addr = 0 if fn is None else fn if isinstance(fn, int) else _address(fn)
        self._ops.append([kind, addr, *args] + [0] * (OP_WORDS - 2 - len(args)))
        self._labels.append(label or _KIND_LABELS[kind])

    def _arg(self, t: torch.Tensor | int) -> int:
        if isinstance(t, int):
            return t
        self._held.append(t)
        return t.data_ptr()

    def _own_dtype(self, *ts: torch.Tensor) -> None:
        for t in ts:
            if t.dtype != self.dtype or not t.is_contiguous() or t.device.type != "cpu":
                raise Unsupported(f"a {t.dtype} tensor of strides {t.stride()}")

    def norm(
        self,
        x: torch.Tensor | int,
        weight: torch.Tensor,
        eps: float,
        out: torch.Tensor,
        *,
        group: int = 1,
        x_stride: int | None = None,
        residual: torch.Tensor | int | None = None,
        sum_into: torch.Tensor | None = None,
        rope: bool = False,
    ) -> None:
        """cpu_kernels.rms_norm's call: out = weight * norm(x [+ residual]), the sum written
        into `sum_into`; x rows `x_stride` apart (default: out's), `group` heads each; rope:
        the step's rotary tables applied after."""
        d = weight.shape[-1]
        self._own_dtype(weight, out)
        if rope and d > 512:
            raise Unsupported("rotary over heads wider than 512")
        rows = out.numel() // d
        stride = x_stride if x_stride is not None else out.stride(0)
        res = 0 if residual is None else self._arg(residual)
        fn = self.lib.norm_bf16 if self.bf16 else self.lib.norm_f32
        self._emit(
            OP_NORM,
            fn,
            self._arg(x),
            group,
            stride,
            res,
            self._arg(sum_into) if sum_into is not None else 0,
            self._arg(weight),
            weight.numel() // d,
            self._arg(out),
            rows,
            d,
            _float_bits(eps),
            int(rope),
            label="C q/k norms + rotary" if rope else "C norms",
        )

    def attention(
        self,
        qk: torch.Tensor,
        v: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        out: torch.Tensor,
        heads: tuple[int, int, int],
        scale: float,
    ) -> None:
        """cpu_kernels.decode_attention's call with the step's rows stored by the kernel: q and
        the new k are the heads of `qk` [B, Hq + Hkv, D], the new v `v` [B, Hkv * D] (rows
        apart by its stride: the last Hkv heads of the q/k/v matmul's output, or a part's
        own output where that weight is split)."""
        hq, hkv, d = heads
        held = (self.dtype, torch.float8_e4m3fn)  # an fp8 pool: the new rows rounded into it
        for pool in (k_pool, v_pool):
            if pool.dtype not in held or not pool.is_contiguous() or pool.shape[1:] != (hkv, d):
                raise Unsupported("a KV pool in another dtype or layout")
        size = qk.element_size()
        fn = cpu_kernels.attention_kernel(self.lib, k_pool.dtype)
        self._emit(
            OP_ATTN,
            fn,
            self._arg(qk),
            (hq + hkv) * d,
            self.bf16,
            self._arg(k_pool),
            self._arg(v_pool),
            self._arg(out),
            self.bf16,
            self.rows,
            hq,
            hkv,
            d,
            _float_bits(scale),
            qk.data_ptr() + hq * d * size,
            (hq + hkv) * d * size,
            v.data_ptr(),
            v.stride(0) * size,
        )

    def silu_mul(self, x: torch.Tensor, out: torch.Tensor) -> None:
        fn = self.lib.silu_mul_bf16 if self.bf16 else self.lib.silu_mul_f32
        self._emit(OP_SILU, fn, self._arg(x), self._arg(out), self.rows, out.shape[1])

    def matmul(
        self, module: Any, x: torch.Tensor | int, out: torch.Tensor, *, step_out: bool = False
    ) -> None:
        """`module`'s x @ W.T into out, by its pick for this row count (a LinearBase without
        bias: CpuLinearKernel's gemv / gemv512 / panel, or a quantized weight's C kernels),
        in the module's kernel_out_dtype where it has one (the LM head's float32 logits).
        step_out: into the step's output buffer instead (`run`'s out, shaped as `out`)."""
        if getattr(module, "bias", None) is not None or getattr(module, "tp_size", 1) != 1:
            raise Unsupported("a bias or a tensor-parallel shard")
        weight, kernel = module.weight, module.kernel
        # The module's own output dtype (the LM head's float32 logits) where it has one.
        out_dtype = getattr(module, "kernel_out_dtype", None)
        if out_dtype is None:
            self._own_dtype(out)
        elif out.dtype != out_dtype or not out.is_contiguous():
            raise Unsupported(f"a matmul into {out.dtype} where its module gives {out_dtype}")
        xa, ya = self._arg(x), FROM_STEP_OUT if step_out else self._arg(out)
        if isinstance(weight, QuantWeight):
            self._quantized(weight, xa, ya, out)
        elif isinstance(kernel, CpuLinearKernel) and kernel.out_dtype == out_dtype:
            self._float(kernel, xa, ya, out)
        else:
            raise Unsupported("a matmul without a CPU kernel")

    def gemv(
        self, weight: torch.Tensor, x: torch.Tensor | int, out: torch.Tensor, pick: str = "gemv"
    ) -> None:
        """x @ weight.T into out by a float weight that is no module's (a router's), through
        the GEMV its pick `pick` names at these rows."""
        if not cpu_kernels.supports(weight) or self.rows > cpu_kernels.MAX_ROWS:
            raise Unsupported(f"a {weight.dtype} weight the GEMV does not take")
        self._own_dtype(out)
        self._gemv(pick, self._arg(x), weight, self._arg(out), self.bf16)

    def _gemv(self, pick: str, xa: int, w: torch.Tensor, ya: int, out_bf16: int) -> None:
        """The one C call pick `pick` makes over row-major w (cpu_linear.gemv_call)."""
        kernel = cpu_linear.gemv_call(pick, self.dtype, w.dtype)
        if kernel is None:
            raise Unsupported(f"pick {pick or 'none'} on a {w.dtype} weight")
        addr, form = kernel
        n, k = w.shape
        if form == 2 and not cpu_kernels.supports_amx(self.dtype, w):
            raise Unsupported(f"pick {pick} on a {tuple(w.shape)} {w.dtype} weight")
        args = (xa, self._arg(w), ya, self.rows, n, k, out_bf16)
        label = f"C matmul {n}x{k} {pick}"
        if form == 1:
            self._emit(OP_MM8, addr, *args, self.bf16, label=label)
        else:
            self._emit(OP_MMI if form == 2 else OP_MM7, addr, *args, label=label)

    def moe(self, block: Any, x: torch.Tensor, out: torch.Tensor) -> None:
        """A SparseMoeBlock's forward at these rows, as it runs on the CPU: the router's GEMV
        into logits, moe.route's C call into the rows' expert ids and weights, and the
        experts' one C call (moe.decode_call; the same call fused_moe makes) into out."""
        experts = block.experts
        if experts.tp_size != 1:
            raise Unsupported("a tensor-parallel shard of the experts")
        w13, w2 = experts.w13, experts.w2
        if isinstance(w13, QuantWeight) and isinstance(w2, QuantWeight):
            call = moe.decode_call(x, w13, w2, w13.expert_matmul, w2.expert_matmul)
        else:
            tokens, names = experts.one_call_tokens, experts.names
            call = moe.decode_call(x, w13, w2, experts.mm13, experts.mm2, tokens, names)
        if call is None:
            raise Unsupported("experts that run one by one at these rows")
        self._own_dtype(x, out)
        k = block.top_k
        logits = self.buffer("router", call.experts)
        self.gemv(block.gate, x, logits, block.route_pick(self.rows))
        weights = self.buffer("route_weights", k)
        ids = self._arg(torch.empty(self.rows, k, dtype=torch.int64))
        args = (self._arg(logits), self.bf16, self.rows, call.experts, k, int(block.renormalize))
        self._emit(OP_ROUTE, self.lib.moe_route, *args, self._arg(weights), self.bf16, ids)
        fn = {"q": self.lib.moe_decode_q, "f": self.lib.moe_decode_f}.get(
            call.kind, self.lib.moe_decode
        )
        self._emit(
            OP_MOE,
            fn,
            self._arg(x),
            self.bf16,
            self._arg(call.w13),
            self._arg(call.w2),
            call.experts,
            ids,
            self._arg(weights),
            self.bf16,
            self._arg(out),
            self.rows,
            k,
            x.shape[1],
            call.inter,
            label=f"C experts {call.kind}",
        )

    def _pick(self, picks: tuple[str, ...]) -> str:
        # The bucket, not row_table's list of every row count: building that for each of a
        # 0.6B model's 113 matmuls took 25 ms of the 25 ms a chain took to build.
        return picks[kernel_choice.bucket_of(max(self.rows, 1))]

    def _float(self, kernel: CpuLinearKernel, xa: int, ya: int, out: torch.Tensor) -> None:
        name = self._pick(kernel.picks)
        w, lib = kernel.weight, self.lib
        n = out.shape[1]
        out_bf16 = int(out.dtype == torch.bfloat16)
        if name == "panel":
            packed = kernel.packed["panel"]
            k = packed.data.shape[1]
            self._held.append(packed)
            args = (xa, packed.data.data_ptr(), ya, self.rows, n, k, out_bf16, self.bf16)
            self._emit(OP_MM8, lib.panel, *args, label=f"C matmul {n}x{k} panel")
            return
        if w is None or w.dtype != self.dtype:
            raise Unsupported(f"pick {name} on a {None if w is None else w.dtype} weight")
        self._gemv(name, xa, w, ya, out_bf16)

    def _quantized(self, weight: QuantWeight, xa: int, ya: int, out: torch.Tensor) -> None:
        w = weight.whole()
        probe = torch.empty(self.rows, w.in_features, dtype=self.dtype)
        # packed: the panels' kernels take it (8-bit codes in groups of 16 only they take)
        if not weight.packed and not cpu_gemv.usable(probe, w):
            raise Unsupported("a quantized weight the C kernels do not take")
        kernel = weight.kernel
        if kernel is not None and not isinstance(kernel, cpu_choice.QuantKernel):
            raise Unsupported("a quantized matmul set up for another device")
        name = self._pick(kernel.picks) if kernel is not None else "qgemv"
        ops = cpu_gemv.operands(w)
        fn = cpu_choice.kernel_fn(self.lib, name, ops.kind, self.bf16)
        if fn is None:  # dequant_gemm / dequant_torch: chunks dequantized from Python
            raise Unsupported(f"quantized pick {name}, which is no single C kernel call")
        if out.shape[1] != ops.n:
            raise Unsupported("a quantized weight of another width")
        self._held.append(ops)
        codes, cstride, scales, zeros, gstride = (a.value or 0 for a in ops.args)
        n, k, group = (a.value for a in ops.sizes)
        weight_args = (codes, cstride, scales, zeros, gstride)
        # The output dtype the kernel writes: the chain's, or the LM head's float32 logits
        # (QuantWeight.matmul's out_dtype: the same kernel call, so the same bits).
        out_bf16 = int(out.dtype == torch.bfloat16)
        label = f"C matmul {n}x{k} {ops.kind} {name}"
        if w.mins is None:
            args = (xa, self.bf16, *weight_args, ya, out_bf16, self.rows, n, k, group)
            self._emit(OP_QMM, fn, *args, label=label)
            return
        # Group mins (cpu_panel.minus_mins): the kernel into float32, then their term into out.
        acc = self._arg(self.buffer("mins_acc", n, dtype=torch.float32))
        self._emit(OP_QMM, fn, xa, self.bf16, *weight_args, acc, 0, self.rows, n, k, group,
                   label=label)  # fmt: skip
        self._held += [t for t in (w.mins, w.mins_scales) if t is not None]
        mins = w.mins_args()
        sizes = (self.rows, n, k, group)
        self._emit(OP_MINS, self.lib.qmins, xa, self.bf16, acc, *mins, ya, out_bf16, *sizes,
                   label=f"C group mins {n}x{k}")  # fmt: skip

    def embedding(self, table: QuantWeight) -> None:
        """The step's token ids' rows of a quantized embedding table (as QuantWeight.rows
        looks up a decode step's few rows: each dequantized by C into fp32, then rounded to
        the chain's dtype) into a buffer the layers then read as the step's input rows. The
        first op, or none: a step whose ids the chain cannot read starts after it."""
        if self._ops:
            raise Unsupported("an embedding lookup after other ops")
        w = table.whole()
        probe = torch.empty(1, w.in_features, dtype=self.dtype)
        if table.lookup is not None or w.mins is not None or not cpu_gemv.usable(probe, w):
            raise Unsupported("an embedding table the C dequantizer does not read")
        ops = cpu_gemv.operands(w)
        self._held.append(ops)
        codes, cstride, scales, zeros, gstride = (a.value or 0 for a in ops.args)
        out = self.embedded = self.buffer("embedded", ops.k)
        scratch = torch.empty(ops.k, dtype=torch.float32)
        weight_args = (codes, cstride, scales, zeros, gstride)
        sizes = (self.rows, ops.k, ops.group, self.bf16)
        # a tied table packed for its LM head's matmul (QuantWeight.pack_vnni) has its own
        fn = (self.lib.qvpanel_rows if table.packed else self.lib.qdequant)[ops.kind]
        self._emit(OP_ROWS, fn, *weight_args, self._arg(out), *sizes, self._arg(scratch))

    def embedding_panels(self, panels: cpu_kernels.PanelWeight) -> None:
        """As `embedding`, for a bf16 table kept only as its tied LM head's panels
        (VocabParallelEmbedding.use_panels): the step's rows copied out in C as
        cpu_kernels.panel_rows reads them (its torch indexing ops were ~0.16 ms of a bf16 B=1
        step after the weights' stream, AMD EPYC Zen 4)."""
        if self._ops:
            raise Unsupported("an embedding lookup after other ops")
        if self.dtype != torch.bfloat16 or panels.data.dtype != torch.bfloat16:
            raise Unsupported("panels of another dtype than the chain's bf16")
        _, k, width = panels.data.shape
        out = self.embedded = self.buffer("embedded", k)
        args = (self._arg(panels.data), k, width, int(panels.pairs), self._arg(out), self.rows)
        self._emit(OP_PROWS, None, *args)

    def rope(self, table: torch.Tensor) -> None:
        """The step's rotary rows, cos and signed sin of each row's position, from `table`
        [2, positions, D] (RotaryEmbedding's float32 tables) into the buffers the norms'
        rotation reads, in the chain's dtype (as RotaryEmbedding.cos_sin's gather and cast);
        before the first norm with `rope`. A step with a position past the table is refused
        (`run` gives False) before any layer runs."""
        if any(op[0] == OP_NORM for op in self._ops):
            raise Unsupported("rotary rows after the norms that read them")
        if table.dtype != torch.float32 or not table.is_contiguous() or table.dim() != 3:
            raise Unsupported("rotary tables other than float32 [2, positions, D]")
        _, positions, d = table.shape
        self.cos, self.sin = self.buffer("cos", d), self.buffer("sin", d)
        sin_table = table.data_ptr() + positions * d * table.element_size()
        args = (self._arg(table), sin_table, positions, d, self.rows, self.bf16)
        self._emit(OP_ROPE, None, *args, label="C rotary rows")

    def mark(self) -> int:
        """The ops emitted so far: a point `drop_after` can go back to, and `run` stop at."""
        return len(self._ops)

    def drop_after(self, mark: int) -> None:
        """Forget the ops emitted after `mark` (a stage that turned out Unsupported)."""
        del self._ops[mark:]
        del self._labels[mark:]

    def seal(self) -> None:
        """The ops as one int64 tensor the C call reads."""
        self.ops = torch.tensor(self._ops, dtype=torch.int64).reshape(-1, OP_WORDS)

    def run(
        self,
        x: torch.Tensor | None,
        positions: torch.Tensor,
        slots: torch.Tensor,
        lens: torch.Tensor,
        new_slots: torch.Tensor,
        upto: int | None = None,
        out: torch.Tensor | None = None,
        ids: torch.Tensor | None = None,
    ) -> bool:
        """One step over input rows x [B, hidden] (contiguous, the chain's dtype), or, None,
        the rows of token ids `ids` [B] (contiguous int64: see `ids_ok`) looked up by the
        chain's `embedding`; the rows' positions [B] (see `positions_ok`) and the
        attention's slots [B, kmax] / lengths [B] / new rows' slots [B] (contiguous int64; see
        TorchAttentionBackend.decode_chain_inputs). `upto`: only the ops before that mark
        (default: all); `out`: the step's output buffer (see `matmul`), needed by ops past the
        layers that write it. False: the step was refused before any layer ran (a position
        past the rotary tables); raises where a matmul failed part-way (see `_ran`)."""
        assert self.cos is not None and self.sin is not None, "no rotary rows (rope)"
        step = self.step
        first = 0
        if x is None:
            assert ids is not None and self.embedded is not None
            step[STEP_IDS] = ids.data_ptr()
            step[STEP_X] = self.embedded.data_ptr()
        else:
            first = int(self.embedded is not None)  # the rows are the caller's: no lookup
            step[STEP_X] = x.data_ptr()
        step[STEP_SLOTS] = slots.data_ptr()
        step[STEP_LENS] = lens.data_ptr()
        step[STEP_KMAX] = slots.shape[1]
        step[STEP_NEW_SLOTS] = new_slots.data_ptr()
        step[STEP_POS] = positions.data_ptr()
        step[STEP_COS] = self.cos.data_ptr()
        step[STEP_SIN] = self.sin.data_ptr()
        step[STEP_OUT] = out.data_ptr() if out is not None else 0
        n = self.ops.shape[0] if upto is None else upto
        ops = self.ops.data_ptr() + first * OP_WORDS * 8
        if timing is None or self.lib.decode_chain_timed is None:
            return _ran(self.lib.decode_chain(ops, n - first, step))
        ns = (ctypes.c_int64 * max(1, n - first))()
        if not _ran(self.lib.decode_chain_timed(ops, n - first, step, ns, int(timing_cpu_clock))):
            return False
        for label, t in zip(self._labels[first:n], ns):
            timing[label] = timing.get(label, 0.0) + t * 1e-9
        return True


def _ran(code: int) -> bool:
    """decode_chain's answer: True (ran), False (refused before any layer ran); raises where a
    matmul failed part-way (the AMX matmul without memory for its packed x)."""
    if code == -2:
        raise RuntimeError("a matmul of the decode chain failed part-way (no memory)")
    return code == 0


_KIND_LABELS = {
    OP_NORM: "C norms",
    OP_ATTN: "C attention",
    OP_SILU: "C SiLU x up",
    OP_MM8: "C matmul",
    OP_MM7: "C matmul",
    OP_MMI: "C matmul",
    OP_QMM: "C matmul",
    OP_ROWS: "C embedding rows",
    OP_PROWS: "C embedding rows",
    OP_ROPE: "C rotary rows",
    OP_ROUTE: "C router top-k",
    OP_MOE: "C experts",
    OP_MINS: "C group mins",
}


def ids_ok(ids: torch.Tensor, rows: int) -> bool:
    """Whether `embedding`'s op reads these token ids as they are."""
    return ids.dtype == torch.int64 and ids.shape == (rows,) and ids.is_contiguous()


def positions_ok(positions: torch.Tensor, rows: int) -> bool:
    """Whether `rope`'s op reads these positions as they are."""
    return (
        positions.dtype == torch.int64 and positions.shape == (rows,) and positions.is_contiguous()
    )


def x_ok(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a step's input rows (the embedding's, looked up apart) are what the chain reads
    as they are."""
    return x.dtype == dtype and x.is_contiguous()
