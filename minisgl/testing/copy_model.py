"""A checkpoint that copies: a model with every attention output projection zeroed.

Each position's logits then depend on its own token only (a bigram model), so the greedy
continuation of a token t is a fixed sequence C(t): fed back inside a prompt ("... t C(t) ...
t"), it is what the model writes again, and ngram drafts copied from the prompt are kept. The
forward pass costs what the original's does (the zeros are multiplied like any weights), which
makes it the copying workload of the speculative-decoding tests and benchmark.
"""

from __future__ import annotations

import shutil
from pathlib import Path


def write_copy_model(src: str | Path, out: str | Path) -> Path:
    """`src` (a local checkpoint directory) with attention outputs zeroed, written to `out`
    once (an existing `out` with a config.json is returned as it is)."""
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if not f.is_file():
            continue
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp / f.name)
            continue
        tensors = load_file(f)
        for name, t in tensors.items():
            if name.endswith("self_attn.o_proj.weight"):
                t.zero_()
        save_file(tensors, tmp / f.name, metadata={"format": "pt"})
        del tensors
    tmp.rename(out)
    return out
