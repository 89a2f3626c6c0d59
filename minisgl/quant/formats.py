"""The published checkpoint layouts, read into minisgl's one layout (qtensor.py).

- fp8 (Qwen's and DeepSeek's FP8 releases): `weight` float8_e4m3fn [N, K] and
  `weight_scale_inv` float32 [ceil(N/b), ceil(K/b)], one per b x b block;
  weight = code * scale. compressed-tensors FP8 has the same codes with `weight_scale`
  [1] (tensor), [N, 1] (channel) or [ceil(N/b), ceil(K/b)] (block).
- awq (AutoAWQ's GEMM version): `qweight` int32 [K, N/8], eight 4-bit codes of one input
  feature per word, output features in the interleaved order 0 2 4 6 1 3 5 7 (nibble i of
  word c holds output feature 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]); `qzeros` int32 [K/g, N/8]
  packed the same way; `scales` float16 [K/g, N]; weight = (code - zero) * scale.
- gptq: `qweight` int32 [K * bits / 32, N], the 32/bits codes of word i of column n being
  input features i * 32/bits + j at bit j * bits; `qzeros` int32 [G, N * bits / 32] packed in
  the same order along the output features; `scales` float16 [G, N]; `g_idx` int32 [K], the
  group of each input feature (k // g unless desc_act reordered them). checkpoint_format gptq
  stores each zero point minus one.
- compressed-tensors integer weights (llm-compressor's W4A16 / W8A16 / W8A8): codes q in
  [-2^(b-1), 2^(b-1)) stored as q + 2^(b-1). pack-quantized: `weight_packed` int32
  [N, K * b / 32], code j of a word being input feature 32/b * word + j at bit j * b;
  `weight_shape` [2] = [N, K]; int-quantized / naive-quantized: `weight` int8 [N, K] (q
  itself). `weight_scale` [N, G] (group), [N, 1] (channel) or [1] (tensor); with zero points
  (symmetric false) `weight_zero_point`, packed along the output features as the codes along
  the inputs ([N * b / 32, G] int32) or int8 [N, G] unpacked; `weight_g_idx` [K] where
  actorder group scattered the groups. weight = (q - zero_point) * scale.
- gguf (llama.cpp's files, models/gguf.py): the projection's `weight` as its raw blocks, uint8 [N,
  K / 32 * block bytes], a block being 32 weights of a row: Q8_0 a float16 scale d and 32 int8
  codes q (weight = q * d); Q4_0 a float16 d and 16 bytes whose low nibbles are weights 0..15 and
  high nibbles 16..31 (weight = (q - 8) * d); Q5_0 a float16 d, a 32-bit word whose bit i is
  weight i's fifth bit, then Q4_0's 16 bytes of low nibbles (weight = (q - 16) * d), held as 8-bit
  codes; Q4_1 / Q5_1 as Q4_0 / Q5_0 with a float16 m after d (weight = d * q + m, held with min
  -m); IQ4_NL as Q4_0, its nibbles indices into IQ4_VALUES (weight = d * table[q], held as 8-bit
  codes table[q] + 128). The K-quants, in super-blocks of 256 weights of a row: Q4_K a float16 d
  and dmin, 12 bytes packing eight 6-bit scales sc and mins m (one per group of 32), then 128
  bytes whose low nibbles are weights 0..31 of each 64 and high nibbles 32..63; Q5_K the same with
  32 bytes (bit g of byte i: weight i of group g's fifth bit) before the nibbles; weight = d * sc
  * q - dmin * m, held as codes q, scale d * sc per group (exact in float32) and the mins in
  qtensor's compact form (m per group, dmin per super-block). Q6_K: 128 bytes of low nibbles
  (byte i of each half's 64: weight i's, then weight 64 + i's), 64 bytes of high bit pairs (byte
  i of each half's 32: weights i, 32 + i, 64 + i, 96 + i at bits 0, 2, 4, 6), 16 int8 scales sc
  (one per group of 16), then the float16 d; weight = d * sc * (q - 32), held as 8-bit codes q,
  zero point 32 and scale d * sc per group of 16 (exact in float32). Q3_K: _q3_k's layout;
  codes 0..7 with zero point 4, scale d * (sc - 32) per 16. IQ4_XS: _iq4_xs's layout; IQ4_NL's
  values with a scale d * (ls - 32) per 32. Q2_K: _q2_k's layout; codes 0..3, a scale d * sc per
  16 and the mins compact (m per 16, dmin per 256).
"""

from __future__ import annotations

import torch

from minisgl.quant.qtensor import FP8, QTensor, pack_nibbles
from minisgl.quant.scheme import (
    GGUF_K_TYPES,
    GGUF_PROJECTION_TYPES,
    QuantScheme,
)

# Nibble i of an AWQ word holds output feature AWQ_ORDER[i] of its eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def parts(scheme: QuantScheme) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(required, optional) tensor suffixes of one quantized linear in the checkpoint."""
    if scheme.source == "load" or scheme.method == "gguf":
        return ("weight",), ()
    if scheme.method == "fp8":
        return ("weight", scheme.fp8_scale_name), ()
    if scheme.method == "awq":
        return ("qweight", "qzeros", "scales"), ()
    if scheme.method == "compressed-tensors":
        codes = ("weight_packed", "weight_shape") if scheme.packed else ("weight",)
        zeros = ("weight_zero_point",) if scheme.zero_point else ()
        if scheme.desc_act:
            return (*codes, "weight_scale", *zeros, "weight_g_idx"), ()
        return (*codes, "weight_scale", *zeros), ("weight_g_idx",)
    if scheme.desc_act:
        return ("qweight", "qzeros", "scales", "g_idx"), ()
    return ("qweight", "qzeros", "scales"), ("g_idx",)


def logical_shape(scheme: QuantScheme, shapes: dict[str, tuple[int, ...]]) -> tuple[int, int]:
    """[out, in] of the float weight a quantized linear stands for (suffix -> shape)."""
    if scheme.method in ("fp8", "gguf") or (
        scheme.method == "compressed-tensors" and not scheme.packed
    ):
        n, k = shapes["weight"]  # a GGUF block tensor's header gives the weight's shape
        return n, k
    if scheme.method == "compressed-tensors":
        n, words = shapes["weight_packed"]
        return n, words * 32 // scheme.bits
    if scheme.method == "awq":
        k, n8 = shapes["qweight"]
        return n8 * 8, k
    kp, n = shapes["qweight"]
    return n, kp * 32 // scheme.bits


def _groups(k: int, group_size: int) -> int:
    return -(-k // group_size) if group_size else 1


def _expect(name: str, t: torch.Tensor, shape: tuple[int, ...], why: str) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} is {list(t.shape)}, but {why} needs {list(shape)}")


def _word_bytes(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., W, 4], byte j holding bits 8j..8j+7 (little-endian hosts:
    the only ones torch's CPU builds target)."""
    return words.contiguous().view(torch.uint8).view(*words.shape, 4)


def _unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., W] -> [..., W, 32/bits] codes, code j of a word from bits j*bits upward."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)


def read_linear(prefix: str, got: dict[str, torch.Tensor], scheme: QuantScheme) -> QTensor:
    """One linear's checkpoint tensors (suffix -> tensor) -> QTensor."""
    if scheme.method == "fp8":
        return _fp8(prefix, got["weight"], got[scheme.fp8_scale_name], scheme)
    if scheme.method == "awq":
        return _awq(prefix, got, scheme)
    if scheme.method == "compressed-tensors":
        return _ct_int(prefix, got, scheme)
    if scheme.method == "gguf":
        return _gguf(prefix, got["weight"], scheme)
    return _gptq(prefix, got, scheme)


def _fp8(prefix: str, w: torch.Tensor, scale: torch.Tensor, scheme: QuantScheme) -> QTensor:
    if w.dtype != FP8:
        raise ValueError(f"{prefix}.weight is {w.dtype}, but an fp8 checkpoint's is float8_e4m3fn")
    n, k = w.shape
    name = f"{prefix}.{scheme.fp8_scale_name}"
    scale = scale.float()
    if scheme.fp8_scales == "block":
        b = scheme.group_size
        _expect(name, scale, (-(-n // b), -(-k // b)), f"a {n}x{k} weight in {b}x{b} blocks")
        rows = scale.repeat_interleave(b, dim=0)[:n].contiguous()
        return QTensor(w, rows, None, None, 8, b, k)
    if scheme.fp8_scales == "channel":
        if scale.numel() != n:
            raise ValueError(f"{name} has {scale.numel()} values, one per output row ({n}) wanted")
        return QTensor(w, scale.reshape(n, 1), None, None, 8, 0, k)
    if scale.numel() != 1:
        raise ValueError(f"{name} has {scale.numel()} values, a per-tensor scale has one")
    return QTensor(w, scale.reshape(1, 1).expand(n, 1).contiguous(), None, None, 8, 0, k)


def _checked_g_idx(
    prefix: str,
    got: dict[str, torch.Tensor],
    name: str,
    k: int,
    groups: int,
    why: str,
    scheme: QuantScheme,
    in_order: str,
) -> torch.Tensor | None:
    """The group of each input feature where they are scattered (desc_act), else None; a g_idx
    that names other groups, or reorders features the config says are in order, is an error."""
    g, g_idx = scheme.group_size, got.get(name)
    regular = torch.arange(k, dtype=torch.int32) // g if g else torch.zeros(k, dtype=torch.int32)
    if g_idx is not None:
        _expect(f"{prefix}.{name}", g_idx, (k,), why)
        g_idx = g_idx.to(torch.int32)
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise ValueError(f"{prefix}.{name} names groups outside 0..{groups - 1}")
        if not scheme.desc_act and not torch.equal(g_idx, regular):
            raise ValueError(
                f"{prefix}.{name} reorders the input features, but config.json says "
                f"{in_order} (the checkpoint is not what its config says)"
            )
    if scheme.desc_act:
        assert g_idx is not None
        return g_idx
    return None


def _per_row(t: torch.Tensor, n: int) -> torch.Tensor:
    """A per-tensor value ([1] or [1, 1]: strategy tensor) as one per row; others as they are."""
    return t.reshape(1, 1).expand(n, 1) if t.numel() == 1 else t


def _ct_int(prefix: str, got: dict[str, torch.Tensor], scheme: QuantScheme) -> QTensor:
    bits, g, mid = scheme.bits, scheme.group_size, 1 << (scheme.bits - 1)
    if scheme.packed:
        words = got["weight_packed"]
        n, k = words.shape[0], words.shape[1] * 32 // bits
        shape = [int(v) for v in got["weight_shape"].flatten().tolist()]
        if shape != [n, k]:
            raise ValueError(
                f"{prefix}.weight_shape is {shape}, but its weight_packed holds a {n}x{k} weight"
            )
        # The words' bytes are the codes + 2^(b-1) in input order, two to a byte (the lower
        # input in the low nibble) or one: minisgl's layout as they are.
        codes = _word_bytes(words).reshape(n, k * bits // 8)
    else:
        q = got["weight"]
        if q.dtype != torch.int8:
            raise ValueError(f"{prefix}.weight is {q.dtype}, but int-quantized codes are int8")
        n, k = q.shape
        codes = q.view(torch.uint8) ^ mid  # q + 128, two's complement
    groups = _groups(k, g)
    why = f"compressed-tensors {bits}-bit, {f'group_size {g}' if g else 'one scale a row'}"
    why += f" on a {n}x{k} weight"
    scale = _per_row(got["weight_scale"].float(), n)
    _expect(f"{prefix}.weight_scale", scale, (n, groups), why)
    if not scheme.zero_point:
        zeros = torch.full((n, groups), mid, dtype=torch.uint8)
    elif scheme.packed:  # packed along the output features: [N * b / 32, G] -> [N, G]
        zp = got["weight_zero_point"]
        _expect(f"{prefix}.weight_zero_point", zp, (n * bits // 32, groups), why)
        zeros = _unpack_words(zp.t().contiguous(), bits).flatten(-2).t().to(torch.uint8)
    else:
        zp = _per_row(got["weight_zero_point"], n)
        _expect(f"{prefix}.weight_zero_point", zp, (n, groups), why)
        zeros = zp.to(torch.int8).view(torch.uint8) ^ mid
    g_idx = _checked_g_idx(
        prefix, got, "weight_g_idx", k, groups, why, scheme, "actorder is not group"
    )
    return QTensor(codes.contiguous(), scale, zeros.contiguous(), g_idx, bits, g, k)


def _awq(prefix: str, got: dict[str, torch.Tensor], scheme: QuantScheme) -> QTensor:
    qweight, qzeros, scales = got["qweight"], got["qzeros"], got["scales"]
    k, n = qweight.shape[0], qweight.shape[1] * 8
    g = scheme.group_size
    if k % g:
        raise ValueError(f"{prefix}: {k} input features are not a whole number of groups of {g}")
    why = f"awq with group_size {g} on a {n}x{k} weight"
    _expect(f"{prefix}.qzeros", qzeros, (k // g, n // 8), why)
    _expect(f"{prefix}.scales", scales, (k // g, n), why)
    back = [AWQ_ORDER.index(j) for j in range(8)]  # nibble holding output feature j

    def unpack(words: torch.Tensor) -> torch.Tensor:  # [R, N/8] int32 -> [R, N] uint8
        b = _word_bytes(words)  # nibble i of a word is byte i // 2's low (even i) or high half
        return torch.stack((b & 15, b >> 4), dim=-1).flatten(-2)[..., back].flatten(-2)

    codes = unpack(qweight).t()  # [N, K]
    zeros = unpack(qzeros).t().to(torch.uint8).contiguous()
    return QTensor(pack_nibbles(codes), scales.float().t().contiguous(), zeros, None, 4, g, k)


def _gptq(prefix: str, got: dict[str, torch.Tensor], scheme: QuantScheme) -> QTensor:
    bits, g = scheme.bits, scheme.group_size
    qweight, qzeros, scales = got["qweight"], got["qzeros"], got["scales"]
    per_word = 32 // bits
    k, n = qweight.shape[0] * per_word, qweight.shape[1]
    groups = _groups(k, g)
    why = f"gptq {bits}-bit, group_size {g or -1} on a {n}x{k} weight"
    _expect(f"{prefix}.qzeros", qzeros, (groups, n // per_word), why)
    _expect(f"{prefix}.scales", scales, (groups, n), why)
    # A word's bytes hold its codes in input order, two per byte with the lower input in the low
    # nibble (4-bit) or one per byte (8-bit): minisgl's layout along K already, so the codes
    # are the words' bytes transposed to [N, K * bits / 8], no unpacking (a 30B checkpoint
    # loads in minutes, not an hour).
    codes = _word_bytes(qweight).permute(1, 0, 2).reshape(n, k * bits // 8)
    zeros = _unpack_words(qzeros, bits).flatten(-2).t()  # [N, G]
    mid = 1 << (bits - 1)
    if scheme.midpoint_zeros:
        if not (bool((zeros == mid).all()) or bool((zeros == mid - 1).all())):
            raise ValueError(
                f"{prefix}.qzeros: symmetric codes' zero points are all {mid} (or {mid - 1}, "
                "stored minus one), but these are not: the checkpoint is not what its config says"
            )
        zeros = torch.full_like(zeros, mid)
    elif scheme.zeros_minus_one:
        zeros = zeros + 1
    g_idx = _checked_g_idx(prefix, got, "g_idx", k, groups, why, scheme, "desc_act false")
    return QTensor(
        codes, scales.float().t().contiguous(), zeros.to(torch.uint8).contiguous(), g_idx,
        bits, g, k,
    )  # fmt: skip


# GGUF type -> (weights a block, bytes a block) of a row's blocks.
_GGUF_BLOCKS = {
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "IQ4_NL": (32, 18), "IQ4_XS": (256, 136), "Q4_K": (256, 144), "Q5_K": (256, 176),
    "Q6_K": (256, 210), "Q3_K": (256, 110), "Q2_K": (256, 84),
}  # fmt: skip
# IQ4_NL's and IQ4_XS's table: 4-bit index -> int8 value (held as code value + 128).
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# A block's decoding: codes [n, S, weights a block] uint8 as held, scales [n, S, groups]
# float32, the zero point, mins [n, S, groups] float32, or the K-quants' (m [n, S, groups]
# uint8, dmin [n, S, 1] float32) (min = dmin * m), or None.
Decoded = tuple[
    torch.Tensor, torch.Tensor, int, torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None
]


def _gguf(prefix: str, blocks: torch.Tensor, scheme: QuantScheme) -> QTensor:
    kind, n = scheme.gguf_type, blocks.shape[0]
    per, per_block = _GGUF_BLOCKS[kind]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % per_block:
        raise ValueError(
            f"{prefix}.weight is {blocks.dtype} {list(blocks.shape)}, not {kind} "
            f"blocks of {per_block} bytes a row"
        )
    b = blocks.reshape(n, -1, per_block)
    k = b.shape[1] * per
    q, scales, zero, mins = _gguf_decode(b, kind)
    codes = q.reshape(n, k)
    codes = codes if scheme.bits == 8 else pack_nibbles(codes)  # minisgl pairs 2j, 2j + 1
    groups = k // scheme.group_size
    zeros = torch.full((n, groups), zero, dtype=torch.uint8)
    w = QTensor(
        codes.contiguous(), scales.reshape(n, groups), zeros, None, scheme.bits,
        scheme.group_size, k,
    )  # fmt: skip
    if isinstance(mins, tuple):  # qtensor's compact form: m per group, dmin per super-block
        m, dmin = mins
        w.mins, w.mins_scales = m.reshape(n, groups).contiguous(), dmin.reshape(n, -1)
    elif mins is not None:
        w.mins = mins.reshape(n, groups)
    return w


def _gguf_decode(b: torch.Tensor, kind: str) -> Decoded:
    if kind == "Q6_K":
        q, scales = _q6_k(b)
        return q, scales, 32, None
    if kind == "Q3_K":
        q, scales = _q3_k(b)
        return q, scales, 4, None
    if kind == "Q2_K":
        return _q2_k(b)
    if kind in GGUF_K_TYPES:
        return _k_quant(b, GGUF_PROJECTION_TYPES[kind])
    if kind == "IQ4_XS":
        return _iq4_xs(b)
    d = _halves(b[..., :2]).unsqueeze(-1)
    if kind == "Q8_0":  # int8 q -> q + 128: flipping the sign bit
        return b[..., 2:] ^ 0x80, d, 128, None
    low = _nibbles(b[..., -16:])
    if kind == "IQ4_NL":
        return _iq4_codes(low), d, 128, None
    if kind in ("Q5_0", "Q5_1"):  # bit i of the word before the nibbles: weight i's fifth bit
        fifth = b[..., -20:-16].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8) & 1
        low |= fifth.flatten(-2) << 4
    if kind in ("Q4_1", "Q5_1"):  # weight = d * q + m: held with min -m
        return low, d, 0, -_halves(b[..., 2:4]).unsqueeze(-1)
    return low, d, 1 << (GGUF_PROJECTION_TYPES[kind] - 1), None


def _halves(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian float16 bytes -> [...] float32."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] codes: byte j's low nibble is weight j, its high j + 16."""
    return torch.cat((b & 15, b >> 4), dim=-1)


def _iq4_codes(index: torch.Tensor) -> torch.Tensor:
    """IQ4 4-bit indices -> their table values + 128 (8-bit codes, zero point 128)."""
    table = torch.tensor(IQ4_VALUES, dtype=torch.int16) + 128
    return table.to(torch.uint8)[index.long()]


def _iq4_xs(b: torch.Tensor) -> Decoded:
    """IQ4_XS super-blocks [n, S, 136]: float16 d, a 16-bit word of the 8 groups' scales' high
    bit pairs (group g at bits 2g), 4 bytes of their low nibbles (group g: byte g / 2, low
    nibble for even g), 8 x 16 bytes of IQ4_NL indices; weight = d * (ls - 32) * table[q]."""
    d = _halves(b[..., 0:2]).unsqueeze(-1)
    high = b[..., 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    groups = torch.arange(8, dtype=torch.int32)
    low = (b[..., 4:8].repeat_interleave(2, dim=-1).to(torch.int32) >> (4 * (groups % 2))) & 15
    ls = low | (((high >> (2 * groups)) & 3) << 4)
    q = _iq4_codes(_nibbles(b[..., 8:].reshape(*b.shape[:2], 8, 16)))
    return q.reshape(*b.shape[:2], 256), d * (ls - 32).float(), 128, None


def _q3_k(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q3_K super-blocks [n, S, 110] -> codes q + 4 [n, S, 256] (0..7) and scales d * sc
    [n, S, 16]: 32 bytes of high bits (weight 32j + i: bit j of byte i, set for the upper
    half of -4..3), 64 bytes of low bit pairs (weight 128h + 32j + i: byte 32h + i at bits 2j),
    12 bytes of 6-bit scales less 32 (group s: the low nibble of byte s, s < 8, or the high one
    of byte s - 8; above them bits 2(s / 4) of byte 8 + s % 4), the float16 d."""
    lead = b.shape[:2]
    shifts = torch.arange(4, dtype=torch.uint8).view(4, 1) * 2
    low = _bit_pairs(b[..., 32:96])
    high = (b[..., :32].unsqueeze(-2) >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1
    q = low | (high.reshape(*lead, 256) << 2)
    sb = b[..., 96:108]
    nib = torch.cat((sb[..., :8] & 15, sb[..., :8] >> 4), dim=-1)
    top = (sb[..., 8:12].unsqueeze(-2) >> shifts) & 3  # [.., s / 4, s % 4]
    sc = (nib | (top.reshape(*lead, 16) << 4)).to(torch.int32) - 32
    return q, _halves(b[..., 108:110]).unsqueeze(-1) * sc.float()


def _bit_pairs(b: torch.Tensor) -> torch.Tensor:
    """[n, S, 64] bytes -> [n, S, 256] 2-bit values: weight 128h + 32j + i at bits 2j of byte
    32h + i (Q2_K's codes, Q3_K's low bits)."""
    shifts = torch.arange(4, dtype=torch.uint8).view(4, 1) * 2
    return ((b.reshape(*b.shape[:2], 2, 1, 32) >> shifts) & 3).reshape(*b.shape[:2], 256)


def _q2_k(b: torch.Tensor) -> Decoded:
    """Q2_K super-blocks [n, S, 84]: 16 bytes of a 4-bit scale sc (low nibble) and min m (high)
    per group of 16, 64 bytes of 2-bit codes (_bit_pairs), the float16 d and dmin; weight =
    d * sc * q - dmin * m."""
    d, dmin = _halves(b[..., 80:82]).unsqueeze(-1), _halves(b[..., 82:84]).unsqueeze(-1)
    sc, m = (b[..., :16] & 15).float(), b[..., :16] >> 4
    return _bit_pairs(b[..., 16:80]), d * sc, 0, (m, dmin)


def _q6_k(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K super-blocks [n, S, 210] -> codes q [n, S, 256] (0..63) and scales d * sc
    [n, S, 16]."""
    lead = b.shape[:2]
    ql = b[..., :128].reshape(*lead, 2, 64)
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32)
    low = torch.cat((ql & 15, ql >> 4), dim=-1)  # [.., half, 128]
    shifts = (2 * torch.arange(4, dtype=torch.uint8)).view(4, 1)
    high = ((qh >> shifts) & 3).reshape(*lead, 2, 128)
    q = (low | (high << 4)).reshape(*lead, 256)
    sc = b[..., 192:208].contiguous().view(torch.int8).float()
    return q, _halves(b[..., 208:210]).unsqueeze(-1) * sc


def _k_quant(b: torch.Tensor, bits: int) -> Decoded:
    """Q4_K / Q5_K super-blocks [n, S, bytes] -> codes [n, S, 8, 32], scales and mins
    [n, S, 8] (group g of a super-block is its weights 32g..32g + 31)."""
    d, dmin = _halves(b[..., 0:2]), _halves(b[..., 2:4])
    packed = b[..., 4:16].reshape(*b.shape[:2], 3, 4)
    low6, high6, rest = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    # groups 0..3: the low 6 bits of bytes 0..3 (scales) and 4..7 (mins); groups 4..7: the
    # low / high nibbles of bytes 8..11 under the top 2 bits of bytes 0..3 / 4..7
    sc = torch.cat((low6 & 63, (rest & 15) | ((low6 >> 2) & 48)), dim=-1)
    m = torch.cat((high6 & 63, (rest >> 4) | ((high6 >> 2) & 48)), dim=-1)
    nibbles = b[..., -128:].reshape(*b.shape[:2], 4, 1, 32)
    q = torch.cat((nibbles & 15, nibbles >> 4), dim=-2).reshape(*b.shape[:2], 8, 32)
    if bits == 5:
        high = b[..., 16:48].unsqueeze(-2) >> torch.arange(8, dtype=torch.uint8).view(8, 1)
        q = q | ((high & 1) << 4)
    return q, d.unsqueeze(-1) * sc.float(), 0, (m, dmin.unsqueeze(-1))
