"""A GGUF file re-encoded tensor by tensor, as llama.cpp's `llama-quantize` makes a Q4_0 (or
mixed) file from the converter's float one, but with gguf-py's reference quantizers (the
C tool needs a build). Every metadata key is copied; `types` picks each tensor's GGUF type
(its name -> a type name, or None to keep it as it is). The GGUF tests use it to make files of
types the converter does not write (Q4_0, Q4_1) and of mixed types."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np


def requantize(src: Path, out: Path, types: Callable[[str], str | None]) -> Path:
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

    reader = GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the writer's own header fields
        if key == "general.file_type":
            continue  # mixed now: llama.cpp reads the tensors' own types
        main = field.types[0]
        sub = field.types[-1] if main == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), main, sub)
    for t in reader.tensors:
        want = types(t.name)
        if want is None or want == t.tensor_type.name:
            data, qtype = np.array(t.data), t.tensor_type
        else:
            values = quants.dequantize(np.array(t.data), t.tensor_type).astype(np.float32)
            qtype = GGMLQuantizationType[want]
            data = quants.quantize(values, qtype)
        writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
