"""A GGUF file's header: its metadata and where each tensor lies (GGUF v2 and v3, little-endian),
the tensors memory-mapped as gguf-py's reader maps them.

gguf-py's GGUFReader makes a numpy view of every part of every metadata value when it opens a
file: Qwen's tokenizer (151k tokens and as many merges) cost it 6-7 s an open, paid by every
process that loads the file (the scheduler, each tensor-parallel rank). This reads the same
header with `struct`, decoding a value only when it is asked for; gguf-py still names the
types and dequantizes the blocks."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9  # GGUFValueType's
# GGUFValueType -> its struct format (little-endian), strings and arrays aside
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}  # fmt: skip
# Tensor types stored as plain numbers (their numpy dtype); the rest are blocks of bytes.
PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
         "I16": np.int16, "I32": np.int32, "I64": np.int64}  # fmt: skip


@dataclass(frozen=True)
class Field:
    """One metadata entry's place in the file."""

    type: int  # GGUFValueType
    sub: int | None  # an array's element type
    start: int  # the entry's first byte (its key's length)
    value: int  # its value's first byte (an array's: its first element's)
    count: int  # an array's elements (1 otherwise)
    end: int  # the byte after it


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # as GGUF lists them: the innermost first
    type: str  # its GGMLQuantizationType's name (Q4_K, F32, ...)
    n_elements: int
    n_bytes: int
    data: np.ndarray  # read-only: [..., innermost] numbers, or [..., bytes a row] blocks


class GgufHeader:
    """The header of the GGUF file at `path`; `value(key)` decodes one metadata value."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            if f.read(4) != MAGIC:
                raise ValueError(f"{self.path} is not a GGUF file (no GGUF magic)")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = np.frombuffer(self._map, dtype=np.uint8)  # read-only, as the mapping
        try:
            self._parse()
        except struct.error:
            raise ValueError(f"{self.path}: a truncated GGUF file (its header)") from None

    def _parse(self) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.version, n_tensors, n_fields = struct.unpack_from("<IQQ", self._map, 4)
        if self.version not in VERSIONS:
            raise ValueError(
                f"{self.path}: GGUF version {self.version} (a big-endian or an old file); "
                f"minisgl reads little-endian versions {', '.join(map(str, VERSIONS))}"
            )
        at = 24
        self.fields: dict[str, Field] = {}
        for _ in range(n_fields):
            key, field = self._field(at)
            if key in self.fields:
                raise ValueError(f"{self.path}: metadata key {key!r} twice")
            self.fields[key] = field
            at = field.end
        infos = []
        for _ in range(n_tensors):
            name, at = self._string(at)
            (n_dims,) = struct.unpack_from("<I", self._map, at)
            dims = struct.unpack_from(f"<{n_dims}Q", self._map, at + 4)
            kind, offset = struct.unpack_from("<IQ", self._map, at + 4 + 8 * n_dims)
            infos.append((name, dims, kind, offset))
            at += 4 + 8 * n_dims + 12
        if len({info[0] for info in infos}) < len(infos):
            raise ValueError(f"{self.path}: a tensor name twice")
        align = self.value("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise ValueError(f"{self.path}: general.alignment {align!r} is not a power of two")
        start = -(-at // align) * align
        self.tensors: list[TensorInfo] = []
        for name, dims, kind, offset in infos:
            try:
                qtype = GGMLQuantizationType(kind)
            except ValueError:
                msg = f"{self.path}: tensor {name!r} of unknown GGML type {kind}"
                raise ValueError(msg) from None
            block, size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(dims))
            n_bytes = n // block * size
            if start + offset + n_bytes > len(self._buf):
                raise ValueError(f"{self.path}: a truncated GGUF file (tensor {name!r})")
            raw = self._buf[start + offset : start + offset + n_bytes]
            shape = tuple(reversed(dims))
            data = raw.view(PLAIN[qtype.name]) if qtype.name in PLAIN else raw
            data = data.reshape(*shape[:-1], -1)
            self.tensors.append(TensorInfo(name, dims, qtype.name, n, n_bytes, data))

    def value(self, key: str, default: Any = None) -> Any:
        """A metadata value as Python: a number, bool or str, an array as a list."""
        f = self.fields.get(key)
        if f is None:
            return default
        if f.type != ARRAY:
            return self._read(f.type, f.value)[0]
        assert f.sub is not None
        return self._items(f.sub, f.value, f.count)[0]

    def raw(self, key: str) -> bytes:
        """The entry's bytes as stored (its key's length and key, type and value)."""
        f = self.fields[key]
        return self._map[f.start : f.end]

    def _field(self, at: int) -> tuple[str, Field]:
        key, value = self._string(at)
        (kind,) = struct.unpack_from("<I", self._map, value)
        value += 4
        if kind != ARRAY:
            return key, Field(kind, None, at, value, 1, self._skip(kind, value, 1))
        sub, count = struct.unpack_from("<IQ", self._map, value)
        first = value + 12
        return key, Field(kind, sub, at, first, count, self._skip(sub, first, count))

    def _skip(self, kind: int, at: int, count: int) -> int:
        """The byte after `count` values of `kind` from `at`, none decoded."""
        if kind in SCALARS:
            return at + count * struct.calcsize(SCALARS[kind])
        if kind == STRING:
            unpack = struct.Struct("<Q").unpack_from
            for _ in range(count):  # ~0.1 s for a 151k-token vocabulary
                at += 8 + unpack(self._map, at)[0]
            return at
        if kind == ARRAY:  # arrays of arrays
            for _ in range(count):
                sub, n = struct.unpack_from("<IQ", self._map, at)
                at = self._skip(sub, at + 12, n)
            return at
        raise ValueError(f"{self.path}: metadata of unknown GGUF value type {kind}")

    def _items(self, kind: int, at: int, count: int) -> tuple[list[Any], int]:
        """`count` values of `kind` from `at`, and the byte after them."""
        if kind in SCALARS:
            fmt = f"<{count}{SCALARS[kind]}"
            return list(struct.unpack_from(fmt, self._map, at)), at + struct.calcsize(fmt)
        out = []
        for _ in range(count):
            item, at = self._read(kind, at)
            out.append(item)
        return out, at

    def _read(self, kind: int, at: int) -> tuple[Any, int]:
        """The value of `kind` at `at`, and the byte after it."""
        if kind == STRING:
            return self._string(at)
        if kind == ARRAY:
            sub, n = struct.unpack_from("<IQ", self._map, at)
            return self._items(sub, at + 12, n)
        if kind not in SCALARS:
            raise ValueError(f"{self.path}: metadata of unknown GGUF value type {kind}")
        fmt = "<" + SCALARS[kind]
        return struct.unpack_from(fmt, self._map, at)[0], at + struct.calcsize(fmt)

    def _string(self, at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._map, at)
        end = at + 8 + n
        return self._map[at + 8 : end].decode("utf-8", errors="replace"), end
