"""Streaming safetensors writer: tensors are produced one chunk at a time and written straight to
disk, so a checkpoint larger than we want to hold in memory (the 0.6B preset) never is."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np

# safetensors dtype tag -> bytes per element. bfloat16 travels as uint16 bit patterns.
DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "BOOL": 1}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors tag: F32 / BF16 / F16

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * DTYPE_BYTES[self.dtype]


# Yields the tensor's elements in row-major order as raw little-endian chunks.
ChunkSource = Callable[[TensorSpec], Iterator[np.ndarray]]


def _header(specs: Sequence[TensorSpec]) -> bytes:
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        entries[spec.name] = {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    # The format wants the data section 8-byte aligned; pad the header with spaces.
    return raw + b" " * (-len(raw) % 8)


def write_safetensors(
    path: Path,
    specs: Sequence[TensorSpec],
    chunks: ChunkSource,
    on_bytes: Callable[[int], None] | None = None,
) -> None:
    header = _header(specs)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for spec in specs:
            written = 0
            for chunk in chunks(spec):
                data = np.ascontiguousarray(chunk).tobytes()
                f.write(data)
                written += len(data)
                if on_bytes is not None:
                    on_bytes(len(data))
            if written != spec.nbytes:
                raise RuntimeError(f"{spec.name}: wrote {written} bytes, expected {spec.nbytes}")
