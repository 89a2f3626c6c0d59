"""A client that leaves while its grammar compiles frees the compile worker: on a server whose
compile bound is 600 s of CPU, a request with another grammar no longer waits behind the
abandoned one's minutes of compiling (it did, for the whole compile or the bound)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import COMMON_FLAGS
from harness import ServerProcess

MSG = [{"role": "user", "content": "hi"}]
# Minutes of xgrammar compiling: each pattern costs 30-85 s of CPU on a 2-core CI box.
SLOW = {"type": "string", "pattern": "^[a-z]{0,20000}$"}
SLOW_SCHEMA = {
    "type": "object",
    "properties": {
        "a": SLOW,
        "b": {**SLOW, "pattern": "^[b-z]{0,20000}$"},
        "c": {**SLOW, "pattern": "^[c-z]{0,20000}$"},
    },
    "required": ["a", "b", "c"],
}


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("grammar-abandoned") / "server.log"
    flags = ("--grammar-compile-timeout", "600")
    server = ServerProcess(tiny_model_dir, log, *COMMON_FLAGS, *flags).wait_ready()
    yield server
    server.stop()


def _completion(srv: ServerProcess, regex: str | None, timeout: float) -> httpx.Response:
    """A regex, or (None) the slow schema."""
    grammar = {"regex": regex} if regex is not None else {"guided_json": SLOW_SCHEMA}
    body = {"prompt": "hi", "max_tokens": 4, **grammar}
    return httpx.post(f"{srv.url}/v1/completions", json=body, timeout=timeout)


def test_an_abandoned_compile_holds_no_other_grammar_up(srv: ServerProcess) -> None:
    warm = _completion(srv, "[0-9]+", timeout=600)  # xgrammar's set-up, once
    assert warm.status_code == 200, warm.text
    with pytest.raises(httpx.ReadTimeout):
        _completion(srv, None, timeout=3)  # the client gives up while it compiles
    # Within half a minute, not the minutes the abandoned compile would take.
    r = _completion(srv, "[a-c]+", timeout=30)
    assert r.status_code == 200, r.text
    assert set(r.json()["choices"][0]["text"]) <= set("abc")
    srv.wait_idle(within=10.0)
    log = srv.logs()
    assert "aborted while its grammar compiled" in log
    assert "compile was stopped: nobody waits for it" in log
