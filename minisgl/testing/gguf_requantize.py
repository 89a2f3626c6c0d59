"""A GGUF file re-encoded tensor by tensor, as llama.cpp's `llama-quantize` makes a Q4_0 (or
mixed) file from the converter's float one, but with gguf-py's reference quantizers (the
C tool needs a build). Every metadata key is copied; `types` picks each tensor's GGUF type
(its name -> a type name, or None to keep it as it is). The GGUF tests use it to make files of
types the converter does not write (Q4_0, Q4_1, the K-quants) and of mixed types.

gguf-py has no quantizer for the K-quants llama-quantize writes (Q4_K, Q5_K: its Q4_K_M and
Q5_K_M files' bulk; Q6_K: their LM head, and v and down in some layers; Q3_K / Q2_K: Q3_K_M's
and Q2_K's bulk) nor for IQ4_NL / IQ4_XS; `quantize` makes them here by plain rounding
(llama.cpp searches each group's scale and min a little further): any such bytes are valid
blocks, and what the tests check is that minisgl reads them as gguf-py's reference dequantizer
does."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from minisgl.quant.scheme import GGUF_K_TYPES, GGUF_TYPES


def requantize(src: Path, out: Path, types: Callable[[str], str | None]) -> Path:
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, quants

    from minisgl.models.gguf_header import GgufHeader

    header = GgufHeader(src)
    writer = GGUFWriter(str(out), header.value("general.architecture"))
    for key, field in header.fields.items():
        if key == "general.architecture":
            continue  # the writer's own header field
        if key == "general.file_type":
            continue  # mixed now: llama.cpp reads the tensors' own types
        sub = GGUFValueType(field.sub) if field.sub is not None else None
        writer.add_key_value(key, header.value(key), GGUFValueType(field.type), sub)
    for t in header.tensors:
        want = types(t.name)
        qtype = GGMLQuantizationType[t.type]
        data = np.array(t.data)
        if want is not None and want != t.type:
            values = quants.dequantize(data, qtype).astype(np.float32)
            qtype = GGMLQuantizationType[want]
            data = quantize(values, want)
        writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


K_BITS = {kind: GGUF_TYPES[kind] for kind in GGUF_K_TYPES}  # K-quants with mins -> bits


def quantize(values: np.ndarray, kind: str) -> np.ndarray:
    """float32 [..., K] -> GGUF blocks of type `kind` (uint8 [..., K / weights a block * its
    bytes]): gguf-py's quantizer, or the K-quants' below."""
    from gguf import GGMLQuantizationType, quants

    if kind in K_BITS:
        return _k_quantize(values.astype(np.float32), K_BITS[kind])
    if kind == "Q6_K":
        return _q6_k_quantize(values.astype(np.float32))
    if kind == "Q3_K":
        return _q3_k_quantize(values.astype(np.float32))
    if kind == "Q2_K":
        return _q2_k_quantize(values.astype(np.float32))
    if kind == "IQ4_NL":
        return _iq4_nl_quantize(values.astype(np.float32))
    if kind == "IQ4_XS":
        return _iq4_xs_quantize(values.astype(np.float32))
    return quants.quantize(values, GGMLQuantizationType[kind])


def _k_quantize(values: np.ndarray, bits: int) -> np.ndarray:
    """Super-blocks of 256: per group of 32, scale (max - min) / (2^bits - 1) and min
    -min(values, 0), both as 6-bit multiples of the super-block's float16 d and dmin; codes
    q = round((value + min) / scale)."""
    lead = values.shape[:-1]
    x = values.reshape(-1, 8, 32)
    low = np.minimum(x.min(-1), 0)
    scale, mins = (x.max(-1) - low) / (2**bits - 1), -low
    d, dmin = _half(scale.max(-1) / 63), _half(mins.max(-1) / 63)
    sc = _six_bits(scale, d)
    m = _six_bits(mins, dmin)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * m
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step[..., None] > 0, np.rint((x + offset[..., None]) / step[..., None]), 0)
    q = np.clip(q, 0, 2**bits - 1).astype(np.uint8)  # [blocks, group, 32]
    packed = np.concatenate(
        [
            (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
            (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4),
        ],
        axis=-1,
    ).astype(np.uint8)
    nibbles = (q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)  # [blocks, 4, 32]
    parts: list[np.ndarray] = [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2)]
    parts.append(packed)
    if bits == 5:  # bit g of byte i: weight i of group g's fifth bit
        fifth = ((q >> 4) & 1).astype(np.uint8) << np.arange(8, dtype=np.uint8)[:, None]
        parts.append(fifth.sum(axis=1, dtype=np.uint8))
    parts.append(nibbles.reshape(-1, 128))
    blocks = np.concatenate(parts, axis=-1)
    return blocks.reshape(*lead, -1)


def _half(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _six_bits(x: np.ndarray, unit: np.ndarray) -> np.ndarray:
    """x [blocks, 8] as multiples 0..63 of each block's float16 `unit`."""
    u = unit.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        n = np.where(u > 0, np.rint(x / u), 0)
    return np.clip(n, 0, 63).astype(np.uint8)


def _q6_k_quantize(values: np.ndarray) -> np.ndarray:
    """Q6_K super-blocks of 256: per group of 16 a signed 8-bit multiple sc of the float16 d,
    codes q in -32..31, weight = d * sc * q; stored as 128 bytes of low nibbles, 64 of high
    bit pairs, the 16 scales, d."""
    lead = values.shape[:-1]
    x = values.reshape(-1, 16, 16)
    d, scales = _multiples(_signed_groups(x, 32), 127, 127)
    sc = scales.astype(np.int8)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step != 0, np.rint(x / step), 0)
    q6 = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 2, 64)  # [half, s, i]
    low = (q6[:, :, 0] & 15) | ((q6[:, :, 1] & 15) << 4)  # weight 64s + i of a half: nibble s
    pairs = (q6.reshape(-1, 2, 4, 32) >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]
    parts = [low.reshape(-1, 128), pairs.sum(axis=2, dtype=np.uint8).reshape(-1, 64)]
    parts += [sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)]
    return np.concatenate(parts, axis=-1).reshape(*lead, -1)


def _multiples(scale: np.ndarray, below: int, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Per super-block (scale [blocks, groups]) a float16 d, max |scale| / below, and each
    group's scale as a whole multiple of it in -below..top."""
    d = _half(np.abs(scale).max(-1) / below)
    u = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        return d, np.clip(np.where(u > 0, np.rint(scale / u), 0), -below, top)


def _signed_groups(x: np.ndarray, top: int) -> np.ndarray:
    """Each group's (last axis) scale, its largest magnitude at code -top (as llama.cpp signs
    it)."""
    peak = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]
    return -peak / top


def _q3_k_quantize(values: np.ndarray) -> np.ndarray:
    """Q3_K super-blocks of 256: per group of 16 a 6-bit multiple sc - 32 of the float16 d,
    codes q in -4..3, weight = d * (sc - 32) * q; stored as 32 bytes of high bits (q >= 0),
    64 of low bit pairs, 12 of scales, d."""
    lead = values.shape[:-1]
    x = values.reshape(-1, 16, 16)
    d, sc = _multiples(_signed_groups(x, 4), 32, 31)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step != 0, np.rint(x / step), 0)
    code = (np.clip(q, -4, 3) + 4).astype(np.uint8).reshape(-1, 256)
    high = (code >> 2).reshape(-1, 8, 32) << np.arange(8, dtype=np.uint8)[:, None]
    ls = (sc + 32).astype(np.uint8)  # [blocks, 16]
    nibbles = (ls[:, :8] & 15) | ((ls[:, 8:] & 15) << 4)
    tops = (ls >> 4).reshape(-1, 4, 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]
    parts = [high.sum(axis=1, dtype=np.uint8), _bit_pairs(code & 3)]
    parts += [nibbles, tops.sum(axis=1, dtype=np.uint8), d.view(np.uint8).reshape(-1, 2)]
    return np.concatenate(parts, axis=-1).reshape(*lead, -1)


def _iq4_indices(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """The table's nearest value to each x / step (step: x's shape but the last axis, 1)."""
    from minisgl.quant.formats import IQ4_VALUES

    table = np.array(IQ4_VALUES, dtype=np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(step != 0, x / step, 0)
    return np.abs(t[..., None] - table).argmin(-1).astype(np.uint8)


def _iq4_pack(index: np.ndarray) -> np.ndarray:
    """[..., 32] indices -> 16 bytes: weight j's in byte j's low nibble, j + 16's in its high."""
    return index[..., :16] | (index[..., 16:] << 4)


def _iq4_nl_quantize(values: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks of 32: a float16 d, 16 bytes of indices into IQ4_VALUES;
    weight = d * table[q]."""
    lead = values.shape[:-1]
    x = values.reshape(-1, 32)
    d = _half(_signed_groups(x, 127))
    index = _iq4_indices(x, d.astype(np.float32)[:, None])
    parts = [d.view(np.uint8).reshape(-1, 2), _iq4_pack(index)]
    return np.concatenate(parts, axis=-1).reshape(*lead, -1)


def _iq4_xs_quantize(values: np.ndarray) -> np.ndarray:
    """IQ4_XS super-blocks of 256: a float16 d, per group of 32 a 6-bit multiple ls - 32 of it
    (the high bit pairs in a 16-bit word, the low nibbles in 4 bytes), the groups' indices as
    IQ4_NL's; weight = d * (ls - 32) * table[q]."""
    lead = values.shape[:-1]
    x = values.reshape(-1, 8, 32)
    d, sc = _multiples(_signed_groups(x, 127), 32, 31)
    index = _iq4_indices(x, (d.astype(np.float32)[:, None] * sc)[..., None])
    ls = sc.astype(np.int32) + 32
    high = ((ls >> 4) << (2 * np.arange(8))).sum(-1).astype(np.uint16)
    low = ((ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)).astype(np.uint8)
    parts = [d.view(np.uint8).reshape(-1, 2), high.view(np.uint8).reshape(-1, 2), low]
    parts.append(_iq4_pack(index).reshape(-1, 128))
    return np.concatenate(parts, axis=-1).reshape(*lead, -1)


def _bit_pairs(code: np.ndarray) -> np.ndarray:
    """[blocks, 256] 2-bit values -> 64 bytes: weight 128h + 32j + i at bits 2j of byte
    32h + i."""
    low = code.reshape(-1, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8))[:, None]
    return low.sum(axis=2, dtype=np.uint8).reshape(-1, 64)


def _q2_k_quantize(values: np.ndarray) -> np.ndarray:
    """Q2_K super-blocks of 256: per group of 16, scale (max - min) / 3 and min -min(values, 0)
    as 4-bit multiples of the float16 d and dmin, codes q in 0..3, weight = d * sc * q -
    dmin * m; stored as 16 bytes of sc | m << 4, 64 of codes, d, dmin."""
    lead = values.shape[:-1]
    x = values.reshape(-1, 16, 16)
    low = np.minimum(x.min(-1), 0)
    scale, mins = (x.max(-1) - low) / 3, -low
    d, dmin = _half(scale.max(-1) / 15), _half(mins.max(-1) / 15)
    units = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc, m = (np.clip(np.where(u > 0, np.rint(v / u), 0), 0, 15) for v, u in
                 ((scale, units[0]), (mins, units[1])))  # fmt: skip
        step, offset = units[0] * sc, units[1] * m
        q = np.where(step[..., None] > 0, np.rint((x + offset[..., None]) / step[..., None]), 0)
    code = np.clip(q, 0, 3).astype(np.uint8).reshape(-1, 256)
    packed = (sc.astype(np.uint8) | (m.astype(np.uint8) << 4)).astype(np.uint8)
    parts = [packed, _bit_pairs(code), d.view(np.uint8).reshape(-1, 2)]
    parts.append(dmin.view(np.uint8).reshape(-1, 2))
    return np.concatenate(parts, axis=-1).reshape(*lead, -1)
