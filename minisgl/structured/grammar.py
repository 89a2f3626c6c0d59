"""xgrammar glue on the scheduler's side: compile grammars (cached), keep a matcher per request,
and mask the batch's logits with xgrammar's own bitmask kernel (CPU and CUDA).

xgrammar imports torch, so nothing here is imported by the API server or the tokenizer workers:
an invalid grammar is found when the scheduler compiles it at `add_request` (once per distinct
grammar: xgrammar's compiler caches by grammar), and the request ends with a 400 naming the
problem. Per step, only the constrained rows of the batch cost anything: a bitmask fill per
constrained row before the forward pass, one masking kernel on the logits after it.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from minisgl.structured.spec import KIND_FIELDS, choice_ebnf, harden_schema

logger = logging.getLogger(__name__)
CACHE_LIMIT_BYTES = 256 * 2**20


class GrammarError(ValueError):
    """A grammar the request supplied cannot be compiled (a 400 naming `param`)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def _clean(exc: Exception) -> str:
    """xgrammar's C++ messages start with a timestamp and a source location: keep the rest."""
    text = str(exc).strip()
    head, sep, tail = text.partition(": ")
    if sep and (".cc:" in head or ".h:" in head):
        return tail.strip()
    return text


class GrammarBackend:
    """Compiles grammars against one tokenizer, set up on the first constrained request.

    xgrammar's import and its vocabulary analysis take a few seconds, paid once, and only by
    servers that get constrained requests. (Not in a background thread: transformers' lazy
    module attributes are not safe to import from two threads at once.)
    """

    def __init__(self, model_path: str, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._tried = False
        self._error: BaseException | None = None
        self._compiler: Any = None
        self._xgr: Any = None
        self._mask: Any = None  # the reused bitmask buffer (fill_bitmask)

    def _setup(self) -> None:
        self._tried = True
        start = time.perf_counter()
        try:
            import xgrammar as xgr
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            # xgrammar's own cache keys compiled grammars by their source: a schema seen before
            # costs nothing. Bounded, so a stream of distinct schemas cannot grow it forever.
            self._compiler = xgr.GrammarCompiler(
                info, max_threads=1, cache_enabled=True, cache_limit_bytes=CACHE_LIMIT_BYTES
            )
            self._xgr = xgr
            logger.info("xgrammar ready in %.1f s", time.perf_counter() - start)
        except Exception as exc:  # reported to each constrained request, never a crash
            logger.warning("structured outputs unavailable: %s", exc)
            self._error = exc

    def _wait(self) -> Any:
        if not self._tried:
            self._setup()
        if self._compiler is None:
            raise GrammarError(
                f"structured outputs are not available on this server: {self._error}", None
            )
        return self._compiler

    def compile(self, kind: str, value: str) -> Any:
        """The compiled grammar; GrammarError with a user-facing message when it is invalid."""
        compiler = self._wait()
        param = KIND_FIELDS.get(kind)
        try:
            if kind == "json_schema":
                schema = json.dumps(harden_schema(json.loads(value)))
                return compiler.compile_json_schema(schema, any_whitespace=False)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(value)
            if kind == "ebnf":
                return compiler.compile_grammar(value)
            if kind == "choice":
                return compiler.compile_grammar(choice_ebnf(json.loads(value)))
            if kind == "structural_tag":
                return compiler.compile_structural_tag(value)
        except Exception as exc:
            raise GrammarError(f"{param or kind} is invalid: {_clean(exc)}", param) from None
        raise GrammarError(f"unknown grammar kind {kind!r}", None)

    def matcher(self, kind: str, value: str) -> Any:
        return self._xgr.GrammarMatcher(self.compile(kind, value))

    def fill_bitmask(self, matchers: list[Any]) -> Any:
        """An int32 bitmask [rows, words] on the CPU, filled for the rows that have a matcher.

        One buffer, reused step after step (allocating it each step cost more than filling
        it): rows without a matcher hold stale bits, so only the constrained rows may be
        applied (`apply_bitmask` takes their indices).
        """
        rows = len(matchers)
        if self._mask is None or self._mask.shape[0] < rows:
            self._mask = self._xgr.allocate_token_bitmask(max(rows, 64), self.vocab_size)
        mask = self._mask[:rows]
        for row, m in enumerate(matchers):
            if m is not None:
                m.fill_next_token_bitmask(mask, row)
        return mask


def apply_bitmask(logits: Any, bitmask: Any, rows: list[int]) -> None:
    """Disallowed tokens of the constrained `rows` to -inf, in place, with xgrammar's kernel."""
    import xgrammar as xgr

    # A blocking copy: the CPU buffer is refilled at the next step.
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
