"""QuantWeight: a layer's quantized weight buffers, standing where its float `weight` was.

A linear layer (or a mixture's stacked experts, with a leading expert dimension) gets one in
place of its float parameter before the model is materialised, so the float weight is never
allocated. It answers the calls the layers' loaders make on a weight (`.data`, `narrow`,
`copy_`, `[e, rows]`) with QTensor views of its buffers, and multiplies through `matmul`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from minisgl.quant import cpu_gemv, cpu_vpanel
from minisgl.quant.matmul import qlinear, through, with_mins
from minisgl.quant.qtensor import FP8, QTensor, dequantize, per_feature, take_rows, without_mins

# Embedding lookups of at most this many ids (decode steps) dequantize row by row in C.
FEW_ROWS = 16


# The most bytes of a mixture's experts pack_vnni repacks at once (its copy beside them).
PACK_BYTES = 256 << 20


def multiplied_weights(model: nn.Module) -> list[QuantWeight]:
    """The model's quantized weights that matmuls multiply by (all but an untied embedding
    table held as stored, which is only looked up): those kernels are chosen, converted and
    counted for."""
    return [m for m in model.modules() if isinstance(m, QuantWeight) and m.multiplied]


class QuantWeight(nn.Module):
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor | None
    mins: torch.Tensor | None
    mins_scales: torch.Tensor | None

    def __init__(
        self,
        out_features: int,
        in_features: int,
        *,
        bits: int,
        fp8: bool,
        group_size: int,
        groups: int,
        scattered_groups: bool,
        experts: int = 0,
        mins: bool = False,
        mins_per: int = 0,
    ) -> None:
        super().__init__()
        lead = (experts,) if experts else ()
        n, k = out_features, in_features
        self.bits, self.group_size, self.in_features = bits, group_size, k
        self.out_features = n  # the codes' shape changes where a GPU repacks them
        self.experts = experts
        if fp8:
            codes = torch.empty(*lead, n, k, dtype=FP8)
        elif bits == 4:
            codes = torch.empty(*lead, n, k // 2, dtype=torch.uint8)
        else:
            codes = torch.empty(*lead, n, k, dtype=torch.uint8)
        self.register_buffer("codes", codes)
        self.register_buffer("scales", torch.empty(*lead, n, groups, dtype=torch.float32))
        zeros = None if fp8 else torch.empty(*lead, n, groups, dtype=torch.uint8)
        self.register_buffer("zeros", zeros)
        g_idx = torch.empty(*lead, k, dtype=torch.int32) if scattered_groups else None
        self.register_buffer("g_idx", g_idx)
        # group mins: float32, or qtensor's compact form (m, and a dmin per mins_per groups)
        mins_dtype = torch.uint8 if mins_per else torch.float32
        group_mins = torch.empty(*lead, n, groups, dtype=mins_dtype) if mins else None
        self.register_buffer("mins", group_mins)
        dmin = torch.empty(*lead, n, groups // mins_per) if mins and mins_per else None
        self.register_buffer("mins_scales", dmin)
        # The CPU matmul measured fastest per row count for this shape (cpu_choice.py), set
        # at start-up; None: the untuned policy.
        self.kernel: Callable[[torch.Tensor, QTensor], torch.Tensor] | None = None
        # Rows looked up by token id (a tied embedding's table), where a GPU conversion left
        # the buffers in a layout `rows` cannot read (cuda_matmul.py); None: from the buffers.
        self.lookup: Callable[[torch.Tensor, torch.dtype], torch.Tensor] | None = None
        self.looked_up = False  # an embedding table too (a tied LM head): see `rows`
        # False: an untied embedding table held as stored (a GGUF file's token_embd), only
        # looked up: no matmul kernel is chosen or converted for it.
        self.multiplied = True
        # The whole weight's view, made once (see `whole`), and per x dtype whether the CPU
        # kernels take it: a decode step multiplies ~110 times, each call's Python on cold
        # caches (the matmuls before it streamed them out).
        self._whole: QTensor | None = None
        self._cpu_ok: dict[torch.dtype, bool] = {}
        self._c_rows: bool | None = None  # whether `rows` may dequantize in C (`_c_takes`)
        # The buffers hold cpu_vpanel's panels (pack_vnni), not row-major codes: only its
        # kernel and `rows` (through cpu_vpanel) read them.
        self.packed = False

    def reset(self) -> None:
        """After materialising: g_idx unset (-1), so the first projection loaded sets it."""
        if self.g_idx is not None:
            self.g_idx.fill_(-1)

    @property
    def shape(self) -> tuple[int, ...]:
        lead = (self.experts,) if self.experts else ()
        return (*lead, self.out_features, self.in_features)

    @property
    def data(self) -> QuantWeight:
        return self

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def view(self, expert: int | slice | None = None, rows: slice | None = None) -> QTensor:
        """Expert `expert`'s tensors (a slice: several experts', leading their shapes), or a
        dense weight's; `rows` of them."""

        def pick(t: torch.Tensor) -> torch.Tensor:
            t = t if expert is None else t[expert]
            return t if rows is None else t[rows]

        g_idx = self.g_idx if expert is None or self.g_idx is None else self.g_idx[expert]
        return QTensor(
            pick(self.codes),
            pick(self.scales),
            pick(self.zeros) if self.zeros is not None else None,
            g_idx,
            self.bits,
            self.group_size,
            self.in_features,
            pick(self.mins) if self.mins is not None else None,
            pick(self.mins_scales) if self.mins_scales is not None else None,
        )

    def __getitem__(self, key: int | slice | tuple[int, slice]) -> QTensor:
        """[e] an expert, [e, rows] an expert's rows, [rows] a dense layer's rows."""
        if isinstance(key, tuple):
            return self.view(key[0], key[1])
        if isinstance(key, slice):
            return self.view(None, key)
        return self.view(key)

    def narrow(self, dim: int, start: int, length: int) -> QTensor:
        return self.view().narrow(dim, start, length)

    def copy_(self, src: QTensor) -> QTensor:
        return self.view().copy_(src)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` dequantized, [*ids.shape, K] of `dtype`: an embedding lookup that reads
        only the looked-up rows' codes (a float copy of the table is never made)."""
        if self.lookup is not None:
            return self.lookup(ids, dtype)
        w = self.whole()
        if w.mins is not None:  # the rest's values in float32, less the mins, rounded once
            values = self._rows(ids, without_mins(w), torch.float32)
            mins = w.float_mins(ids.reshape(-1))
            assert mins is not None
            mins = per_feature(mins, w)
            return (values - mins.view_as(values)).to(dtype)
        return self._rows(ids, w, dtype)

    def _rows(self, ids: torch.Tensor, w: QTensor, dtype: torch.dtype) -> torch.Tensor:
        if ids.numel() <= FEW_ROWS and ids.device.type == "cpu" and self._c_takes(w):
            # A decode step's few tokens: each row by the C dequantizer (the same values as
            # qtensor.dequantize's), one call instead of ~12 torch ops on cold caches.
            flat = ids.reshape(-1).tolist()
            if self.packed:  # a tied LM head's panels: the rows gathered out of them
                out = cpu_vpanel.dequant_rows(w, flat)
            else:
                parts = [cpu_gemv.dequant_rows(w, i, i + 1) for i in flat]
                out = parts[0] if len(parts) == 1 else torch.cat(parts)
            out = out.to(dtype)
        else:
            gather = cpu_vpanel.take_rows if self.packed else take_rows
            out = dequantize(gather(w, ids), dtype)
        return out.view(*ids.shape, self.in_features)

    def _c_takes(self, w: QTensor) -> bool:
        """Whether the C dequantizer reads this weight (qlinear's test for the C kernels)."""
        if self._c_rows is None:
            probe = torch.empty(1, self.in_features)
            self._c_rows = w.codes.device.type == "cpu" and cpu_gemv.usable(probe, w)
        return self._c_rows

    def load_rows(self, src: QTensor) -> None:
        """Rows [0, n) from `src`, the rest (a vocabulary's padding on the last rank) zero."""
        n = src.shape[0]
        self.view(rows=slice(0, n)).copy_(src)
        self.codes[n:].view(torch.uint8).zero_()  # fp8 codes too: 0x00 is +0.0
        self.scales[n:].zero_()  # a zero scale: every padding weight dequantizes to 0
        if self.mins is not None:
            self.mins[n:].zero_()
        if self.mins_scales is not None:
            self.mins_scales[n:].zero_()

    def whole(self) -> QTensor:
        """view() of every row, kept while the buffers are the same tensors (a GPU conversion
        or `.to` replaces them: a new view then)."""
        w, b = self._whole, self._buffers
        if (
            w is None
            or w.codes is not b["codes"]
            or w.scales is not b["scales"]
            or w.zeros is not b["zeros"]
            or w.g_idx is not b["g_idx"]
            or w.mins is not b["mins"]
            or w.mins_scales is not b["mins_scales"]
        ):
            w = self._whole = self.view()
            self._cpu_ok, self._c_rows = {}, None
        return w

    def pack_vnni(self) -> None:
        """The buffers rewritten in place into cpu_vpanel's panels (the same shapes and bytes,
        so the same memory and huge pages), after which only `kernel` (the chooser's packed
        kernels, cpu_choice.PACKED_KERNELS, for every row count) multiplies by them. A
        mixture's experts in runs of PACK_BYTES at most: no more than that beside them, in a
        few large copies (one expert at a time, the 48 layers of Qwen3-30B-A3B took 14 s of its
        start-up on a 2-core Zen 4)."""
        if self.packed:
            return
        per_expert = self.nbytes() // max(1, self.experts)
        step = max(1, PACK_BYTES // per_expert)
        runs: list[slice | None] = [slice(e, e + step) for e in range(0, self.experts, step)]
        for run in runs or [None]:
            packed = cpu_vpanel.pack(self.view(run))
            pairs = ((self.codes, packed.codes), (self.scales, packed.scales))
            for dst, src in (*pairs, (self.zeros, packed.zeros)):
                if dst is not None and src is not None:
                    (dst if run is None else dst[run]).copy_(src)
        self.packed = True

    def matmul(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x @ W.T in `out_dtype` (default x's; see qlinear)."""
        w = self.whole()
        kernel = self.kernel
        if self.packed:  # flattened to 2-D
            y = self._panels(x.reshape(-1, self.in_features), w, out_dtype)
            return y.view(*x.shape[:-1], y.shape[-1])
        if kernel is not None and x.device.type == "cpu" and x.dim() == 2 and w.mins is None:
            ok = self._cpu_ok.get(x.dtype)
            if ok is None:  # the weight's side of qlinear's test, once per dtype
                ok = self._cpu_ok[x.dtype] = cpu_gemv.usable(x, w)
            if ok:
                return kernel(x, w) if out_dtype is None else through(kernel, x, w, out_dtype)
        return qlinear(x, w, kernel, out_dtype)

    def expert_matmul(self, x: torch.Tensor, w: QTensor) -> torch.Tensor:
        """One expert's x @ w.T, `w` a view of these buffers (the fused MoE's matmul)."""
        if self.packed:
            return self._panels(x, w, None)
        return qlinear(x, w, self.kernel)

    def _panels(self, x: torch.Tensor, w: QTensor, out_dtype: torch.dtype | None) -> torch.Tensor:
        """x @ w.T by the panels' own kernel, whatever the rows (with the group mins, where the
        weight has them, as qlinear takes them)."""
        kernel = self.kernel
        assert kernel is not None
        if w.mins is None:
            return through(kernel, x, w, out_dtype)
        return with_mins(lambda x, bare, dtype: through(kernel, x, bare, dtype), kernel, x, w,
                         out_dtype)  # fmt: skip

    def extra_repr(self) -> str:
        return f"shape={list(self.shape)}, bits={self.bits}, group_size={self.group_size}"
