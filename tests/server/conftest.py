"""One live server for the whole server suite (start-up is the expensive part)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from harness import ServerProcess

# Small pages and context keep memory low; the context is the model's own (4096).
COMMON_FLAGS = ("--num-pages", "2048", "--page-size", "16", "--log-level", "info")


@pytest.fixture(scope="session")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = ServerProcess(tiny_model_dir, log, *COMMON_FLAGS).wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
