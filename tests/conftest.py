"""Session-wide fixtures: random Qwen3 checkpoints with the real Qwen3 tokenizer, written once.

torch is not imported here (the Kubernetes tests never need it); thread counts are capped
through the environment, which torch and spawned workers read when they start.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

# Tiny models gain little from many threads, and server tests run several processes at once.
_THREADS = str(max(1, min(2, os.cpu_count() or 1)))
os.environ.setdefault("OMP_NUM_THREADS", _THREADS)
os.environ.setdefault("MKL_NUM_THREADS", _THREADS)
# Hugging Face tokenizers warn (and may deadlock) when a process forks after using them.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "torch" in sys.modules:  # a plugin imported it already; the env var came too late
    sys.modules["torch"].set_num_threads(int(_THREADS))


def _write(tmp_path_factory: pytest.TempPathFactory, name: str, **kwargs: Any) -> Path:
    from minisgl.testing.fixture import write_fixture_model

    return write_fixture_model(tmp_path_factory.mktemp(name), "tiny", **kwargs)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen3 (hidden 64, 2 layers, 4 heads / 2 kv heads), tied, float32, std 0.5."""
    return _write(tmp_path_factory, "qwen3-tiny")


@pytest.fixture(scope="session")
def tiny_untied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """As tiny_model_dir but with a separate lm_head.weight."""
    return _write(tmp_path_factory, "qwen3-tiny-untied", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_sharded_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same weights as tiny_model_dir, split over two safetensors files plus an index."""
    return _write(tmp_path_factory, "qwen3-tiny-sharded", num_shards=2)


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_model_dir: Path) -> Any:
    """transformers' AutoTokenizer for the fixture model (the real Qwen3 tokenizer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
