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


# MINISGL_TEST_PRESET=qwen3-moe (or qwen2, llama) runs every test that uses tiny_model_dir
# (server, metrics, engine) on that architecture instead of dense Qwen3.
TINY_PRESET = os.environ.get("MINISGL_TEST_PRESET", "tiny")
# MINISGL_TEST_WRITER=transformers has the installed transformers' save_pretrained write those
# fixtures (its config.json keys) instead of the project's writer.
WRITER = os.environ.get("MINISGL_TEST_WRITER", "minisgl")


def _write(
    tmp_path_factory: pytest.TempPathFactory, name: str, preset: str = TINY_PRESET, **kwargs: Any
) -> Path:
    from minisgl.testing.fixture import write_fixture_model

    kwargs.setdefault("writer", WRITER)
    return write_fixture_model(tmp_path_factory.mktemp(name), preset, **kwargs)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen3 (hidden 64, 2 layers, 4 heads / 2 kv heads), tied, float32, std 0.5."""
    return _write(tmp_path_factory, "qwen3-tiny")


@pytest.fixture(scope="session")
def moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen3-MoE: 3 layers (layer 1 dense), 16 experts, top-4, tied, float32."""
    return _write(tmp_path_factory, "qwen3-moe-tiny", "qwen3-moe")


@pytest.fixture(scope="session")
def qwen2_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen2 (q/k/v biases, no q/k norm), tied, float32."""
    return _write(tmp_path_factory, "qwen2-tiny", "qwen2")


@pytest.fixture(scope="session")
def llama_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Llama 3 (llama3 RoPE scaling), untied head, float32."""
    return _write(tmp_path_factory, "llama-tiny", "llama", tie_word_embeddings=False)


# The same four architectures written by the installed transformers' own save_pretrained: a key
# a new transformers release renames in config.json (Qwen3-MoE's num_experts became
# num_local_experts in 5.x) reaches these, whatever the project's writer spells.
@pytest.fixture(scope="session")
def transformers_qwen3_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory, "qwen3-by-transformers", "tiny", writer="transformers")


@pytest.fixture(scope="session")
def transformers_moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory, "moe-by-transformers", "qwen3-moe", writer="transformers")


@pytest.fixture(scope="session")
def transformers_qwen2_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory, "qwen2-by-transformers", "qwen2", writer="transformers")


@pytest.fixture(scope="session")
def transformers_llama_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(
        tmp_path_factory,
        "llama-by-transformers",
        "llama",
        tie_word_embeddings=False,
        writer="transformers",
    )


@pytest.fixture(scope="session")
def tiny_untied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """As tiny_model_dir but with a separate lm_head.weight."""
    return _write(tmp_path_factory, "qwen3-tiny-untied", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_sharded_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same weights as tiny_model_dir, split over two safetensors files plus an index
    (always the project's writer: transformers picks its own shard sizes)."""
    return _write(tmp_path_factory, "qwen3-tiny-sharded", num_shards=2, writer="minisgl")


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_model_dir: Path) -> Any:
    """transformers' AutoTokenizer for the fixture model (the real Qwen3 tokenizer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
