"""Grammar compiles: strict JSON strings at xgrammar's own compile cost, the compile worker's
time bound, and a scheduler loop that goes on stepping while a grammar compiles."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from minisgl.structured.grammar import GrammarBackend, GrammarError
from minisgl.structured.tool_grammar import tool_call_grammar

VOCAB = 151936
STOP = [151645]
# A regex repetition xgrammar needs minutes to compile (85 s on a 2-core CI box).
# The compile bound under test (not a wait: the hygiene check's deadlines are for waits).
COMPILE_BOUND_S = 2.0
SLOW = json.dumps({"type": "string", "pattern": "^[a-z]{0,20000}$"})


@pytest.fixture(scope="module")
def backend(tiny_model_dir: Path) -> GrammarBackend:
    return GrammarBackend(str(tiny_model_dir), VOCAB, STOP)


def _accepts(backend: GrammarBackend, kind: str, value: str, text: str) -> bool:
    matcher = backend.matcher(kind, value)
    return bool(matcher.accept_string(text))


def test_bounded_strings_hold_no_raw_control_characters(backend: GrammarBackend) -> None:
    schema = json.dumps({"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}})
    assert _accepts(backend, "json_schema", schema, '{"s": "abc"}')
    assert not _accepts(backend, "json_schema", schema, '{"s": "a\tb"}')
    assert not _accepts(backend, "json_schema", schema, '{"s": "abcd"}')
    # The same inside a forced tool call's arguments (a structural tag).
    params = {
        "type": "object",
        "properties": {"q": {"type": "string", "minLength": 1, "maxLength": 8}},
    }
    tag = tool_call_grammar([("find", params)], parallel=False)
    call = '<tool_call>\n{"name": "find", "arguments": {"q": "x%sy"}}\n</tool_call>'
    assert _accepts(backend, "structural_tag", tag, call % "")
    assert not _accepts(backend, "structural_tag", tag, call % "\x00")


def test_a_long_bounded_string_compiles_at_xgrammar_cost(backend: GrammarBackend) -> None:
    """maxLength 5000 took xgrammar 64.6 s through a pattern; a counted range takes ms."""
    backend.compile("json_object", "")  # xgrammar set up
    big = {"type": "string", "maxLength": 5000}
    schema = json.dumps({"type": "object", "properties": {"a": big, "b": big}, "required": ["a"]})
    start = time.monotonic()
    backend.compile("json_schema", schema)
    assert time.monotonic() - start < 10  # coarse: the pattern route took minutes


def test_the_cache_is_keyed_by_grammar_and_bounded(tiny_model_dir: Path) -> None:
    small = GrammarBackend(str(tiny_model_dir), VOCAB, STOP, cache_limit_bytes=1)
    first = small.compile("regex", "a+")
    assert small.compile("regex", "a+") is first  # cached
    small.compile("regex", "b+")
    assert small.has("regex", "b+") and not small.has("regex", "a+")  # least recent went
    assert small.num_cached == 1


def test_compile_worker_bounds_a_compile_and_keeps_compiling(tiny_model_dir: Path) -> None:
    from minisgl.structured.compile_worker import GrammarCompileService

    backend = GrammarBackend(str(tiny_model_dir), VOCAB, STOP)
    service = GrammarCompileService(backend, timeout_s=COMPILE_BOUND_S)
    try:
        service.submit("regex", "[0-9]+")
        service.submit("regex", "[0-9]+")  # the same grammar waits once
        (warm,) = _outcomes(service, 1, within=600)  # the first waits for xgrammar's set-up
        assert warm.error is None and warm.serialized
        assert service.info_json is not None  # the vocabulary analysis, for other ranks
        service.submit("json_schema", SLOW)
        service.submit("regex", "[a-c]+")
        start = time.monotonic()
        slow, after = _outcomes(service, 2, within=300)
        assert isinstance(slow.error, GrammarError) and slow.compiled is None
        assert "longer than 2 s" in str(slow.error) and slow.error.param == "response_format"
        assert time.monotonic() - start < 120  # the bound and a restart, never the 85 s
        assert after.error is None and after.compiled is not None
        matcher = backend._xgr.GrammarMatcher(after.compiled)
        assert matcher.accept_string("abc") and not matcher.accept_string("d")
        service.submit("regex", "(")
        (bad,) = _outcomes(service, 1, within=60)
        assert isinstance(bad.error, GrammarError) and bad.error.param == "regex"
    finally:
        service.close()


def test_a_grammar_nobody_waits_for_holds_no_other_up(tiny_model_dir: Path) -> None:
    """A client that went away while its grammar compiled held the single compile worker
    for the whole --grammar-compile-timeout (here 600 s of CPU): other grammars waited
    behind it. A cancelled compile is stopped (or skipped, when queued) and never reported."""
    from minisgl.structured.compile_worker import GrammarCompileService

    backend = GrammarBackend(str(tiny_model_dir), VOCAB, STOP)
    service = GrammarCompileService(backend, timeout_s=600.0)
    try:
        service.submit("regex", "[0-9]+")
        _outcomes(service, 1, within=600)  # xgrammar's set-up, once
        service.submit("json_schema", SLOW)  # minutes of compiling
        service.submit("regex", "x+")  # queued behind it
        service.submit("regex", "[a-c]+")
        time.sleep(0.5)  # the slow one runs now
        service.cancel("regex", "x+")  # its client left while it waited in the queue
        service.cancel("json_schema", SLOW)  # ... and this one's while it compiled
        (after,) = _outcomes(service, 1, within=60)  # not the minutes SLOW takes
        assert (after.kind, after.value, after.error) == ("regex", "[a-c]+", None)
        matcher = backend._xgr.GrammarMatcher(after.compiled)
        assert matcher.accept_string("abc") and not matcher.accept_string("d")
        # Wanted again after a cancel: compiled and reported, whichever way the race went.
        service.submit("regex", "y+")
        service.cancel("regex", "y+")
        service.submit("regex", "y+")
        (again,) = _outcomes(service, 1, within=60)
        assert (again.value, again.error) == ("y+", None) and again.compiled is not None
    finally:
        service.close()


def _outcomes(service: Any, n: int, within: float) -> list[Any]:
    got: list[Any] = []
    deadline = time.monotonic() + within
    while len(got) < n:
        assert time.monotonic() < deadline, f"{len(got)} of {n} compiles done in {within} s"
        got += service.outcomes()
        time.sleep(0.01)
    assert not service.busy
    return got


class _Engine:
    """An engine whose grammar compiles take as long as the test says."""

    max_seq_len = 100
    eos_token_ids: list[int] = []

    def __init__(self) -> None:
        self.added: list[str] = []
        self.steps = 0
        self.ready: set[tuple[str, str]] = set()
        self.done: list[Any] = []
        self.requested: list[tuple[str, str]] = []
        self.cancelled: list[tuple[str, str]] = []

    def has_unfinished(self) -> bool:
        return True

    def step(self) -> list[Any]:
        self.steps += 1
        time.sleep(0.002)
        return []

    def validate(self, prompt_ids: list[int], params: Any, *, compile_grammar: bool = True) -> None:
        assert not compile_grammar

    def grammar_ready(self, kind: str, value: str) -> bool:
        return (kind, value) in self.ready

    def request_grammar(self, kind: str, value: str) -> None:
        self.requested.append((kind, value))

    def cancel_grammar(self, kind: str, value: str) -> None:
        self.cancelled.append((kind, value))

    def finished_grammars(self) -> list[Any]:
        done, self.done = self.done, []
        return done

    def install_grammar(self, outcome: Any) -> None:
        self.ready.add((outcome.kind, outcome.value))

    def add_request(self, rid: str, *args: Any, **kwargs: Any) -> None:
        self.added.append(rid)

    def abort_request(self, rid: str, index: int | None = None) -> bool:
        return False

    def stats(self) -> Any:
        raise AssertionError("no stats in this test")


class _Out:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def put(self, msg: Any) -> None:
        self.sent.append(msg)


def test_the_loop_steps_while_a_grammar_compiles() -> None:
    from minisgl.engine.worker import SchedulerLoop
    from minisgl.message.tokenizer_to_scheduler import TokenizedRequest
    from minisgl.sampling_params import SamplingParams
    from minisgl.structured.compile_worker import CompileOutcome

    engine = _Engine()
    out = _Out()
    loop = SchedulerLoop(engine, None, out, logging.getLogger("test"))  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=4, grammar_kind="regex", grammar="a+")
    loop.add(TokenizedRequest("r1", [1, 2], params, 4, time.time()))
    assert loop.compiling and engine.added == []  # waits beside the loop
    for _ in range(5):
        loop.step()  # nobody else waits
    assert engine.steps == 5
    engine.done.append(CompileOutcome("regex", "a+", compiled=object(), serialized="{}"))
    loop.collect_grammars()
    assert engine.added == ["r1"] and not loop.compiling
    # A failed compile ends its requests with a 400 naming the field.
    bad = SamplingParams(max_tokens=4, grammar_kind="regex", grammar="(")
    loop.add(TokenizedRequest("r2", [1], bad, 4, time.time()))
    loop.add(TokenizedRequest("r3", [1], bad, 4, time.time()))
    engine.done.append(
        CompileOutcome("regex", "(", error=GrammarError("regex is invalid", "regex"))
    )
    loop.collect_grammars()
    ended = [m for m in out.sent if type(m).__name__ == "RequestEnded"]
    assert [(m.rid, m.status, m.param) for m in ended] == [
        ("r2", 400, "regex"),
        ("r3", 400, "regex"),
    ]
    assert engine.added == ["r1"]


def test_the_loop_cancels_a_compile_once_nobody_waits_for_it() -> None:
    from minisgl.engine.worker import SchedulerLoop
    from minisgl.message.api_to_tokenizer import AbortRequest
    from minisgl.message.tokenizer_to_scheduler import TokenizedRequest
    from minisgl.sampling_params import SamplingParams

    engine = _Engine()
    out = _Out()
    loop = SchedulerLoop(engine, None, out, logging.getLogger("test"))  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=4, grammar_kind="regex", grammar="a+")
    for rid in ("r1", "r2"):
        loop.add(TokenizedRequest(rid, [1, 2], params, 4, time.time()))
    loop.handle(AbortRequest("r1"))
    assert engine.cancelled == []  # r2 still waits for it
    loop.handle(AbortRequest("r2"))
    assert engine.cancelled == [("regex", "a+")] and not loop.compiling
    ended = [(m.rid, m.reason) for m in out.sent if type(m).__name__ == "RequestEnded"]
    assert ended == [("r1", "abort"), ("r2", "abort")]
