"""xgrammar glue on the scheduler's side: compiled grammars (cached by grammar), a matcher per
request, and the batch's logits masked with xgrammar's own bitmask kernel (CPU and CUDA).

xgrammar imports torch, so nothing here is imported by the API server or the tokenizer workers.
Where grammars compile depends on who asks. The server's scheduler never compiles in its loop:
`compile_worker` compiles in a child process and hands back serialized grammars, which
`install` puts in this cache (and tensor parallelism broadcasts to the other ranks). The offline
`LLM` compiles in-process on `compile`, as its caller waits anyway. Per step, only the
constrained rows cost anything: a bitmask fill per constrained row before the forward pass,
one masking kernel on the logits after it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from typing import Any

from minisgl.structured.spec import KIND_FIELDS, choice_ebnf
from minisgl.structured.strict_strings import json_schema_ebnf, strict_structural_tag

logger = logging.getLogger(__name__)
CACHE_LIMIT_BYTES = 256 * 2**20
GrammarKey = tuple[str, str]  # (kind, value): see minisgl.structured.spec


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


def compile_with(compiler: Any, kind: str, value: str) -> Any:
    """Compile one grammar with an xgrammar GrammarCompiler; GrammarError with a user-facing
    message when it is invalid. JSON has no free whitespace, and its length-bounded strings no
    raw control characters (strict_strings)."""
    param = KIND_FIELDS.get(kind)
    try:
        if kind == "json_schema":
            return compiler.compile_grammar(json_schema_ebnf(value, any_whitespace=False))
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(value)
        if kind == "ebnf":
            return compiler.compile_grammar(value)
        if kind == "choice":
            return compiler.compile_grammar(choice_ebnf(json.loads(value)))
        if kind == "structural_tag":
            tag = strict_structural_tag(json.loads(value))
            return compiler.compile_structural_tag(json.dumps(tag, ensure_ascii=False))
    except Exception as exc:
        raise GrammarError(f"{param or kind} is invalid: {_clean(exc)}", param) from None
    raise GrammarError(f"unknown grammar kind {kind!r}", None)


def build_tokenizer_info(model_path: str, vocab_size: int, stop_token_ids: list[int]) -> Any:
    """xgrammar's view of the vocabulary: seconds of work (the compile worker does it once)."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
    )


class GrammarBackend:
    """One engine's compiled grammars, keyed by grammar, and its bitmask buffer.

    The vocabulary analysis comes either from a serialized copy (`adopt_info`: the server's
    compile worker made it) or, for in-process compiles, built on first need (a few seconds,
    paid once and only by engines that get constrained requests).
    """

    def __init__(
        self,
        model_path: str,
        vocab_size: int,
        stop_token_ids: list[int],
        *,
        cache_limit_bytes: int | None = CACHE_LIMIT_BYTES,
    ) -> None:
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.cache_limit_bytes = cache_limit_bytes  # None: evicts only when told (TP followers)
        self._cache: OrderedDict[GrammarKey, tuple[Any, str | None, int]] = OrderedDict()
        self._cache_bytes = 0
        self._lock = threading.Lock()  # adopt_info runs in the compile worker's thread
        self._info: Any = None
        self._error: BaseException | None = None
        self._compiler: Any = None  # in-process compiles only
        self._xgr: Any = None
        self._mask: Any = None  # the reused bitmask buffer (fill_bitmask)

    # ---- the vocabulary ---------------------------------------------------------------------
    def adopt_info(self, info_json: str) -> None:
        """Take the vocabulary analysis from its serialized form (fast, no tokenizer load)."""
        if self._info is not None:
            return  # rank 0 made it: its compile worker adopted it already
        import xgrammar as xgr

        info = xgr.TokenizerInfo.deserialize_json(info_json)
        with self._lock:
            if self._info is None:
                self._xgr, self._info = xgr, info

    def _ready_info(self) -> Any:
        with self._lock:
            if self._info is None and self._error is None:
                start = time.perf_counter()
                try:
                    import xgrammar as xgr

                    info = build_tokenizer_info(
                        self.model_path, self.vocab_size, self.stop_token_ids
                    )
                    self._xgr, self._info = xgr, info
                    logger.info("xgrammar ready in %.1f s", time.perf_counter() - start)
                except Exception as exc:  # reported to each constrained request, never a crash
                    logger.warning("structured outputs unavailable: %s", exc)
                    self._error = exc
            if self._info is None:
                raise GrammarError(
                    f"structured outputs are not available on this server: {self._error}", None
                )
            return self._info

    # ---- the cache --------------------------------------------------------------------------
    def has(self, kind: str, value: str) -> bool:
        return (kind, value) in self._cache

    def compile(self, kind: str, value: str) -> Any:
        """The compiled grammar: from the cache, else compiled here and now."""
        entry = self._cache.get((kind, value))
        if entry is not None:
            self._cache.move_to_end((kind, value))
            return entry[0]
        info = self._ready_info()
        if self._compiler is None:
            self._compiler = self._xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        compiled = compile_with(self._compiler, kind, value)
        self.install(kind, value, compiled, None)
        return compiled

    def deserialize(self, serialized: str) -> Any:
        """A compiled grammar from the compile worker (needs the vocabulary adopted first)."""
        return self._xgr.CompiledGrammar.deserialize_json(serialized, self._ready_info())

    def install(
        self, kind: str, value: str, compiled: Any, serialized: str | None
    ) -> list[GrammarKey]:
        """Cache a compiled grammar (with its serialized form, for other ranks); returns the
        grammars evicted to make room (least recently used first)."""
        key = (kind, value)
        size = int(compiled.memory_size_bytes) + len(serialized or "")
        self.forget(key)
        self._cache[key] = (compiled, serialized, size)
        self._cache_bytes += size
        evicted: list[GrammarKey] = []
        limit = self.cache_limit_bytes
        while limit is not None and self._cache_bytes > limit and len(self._cache) > 1:
            old = next(iter(self._cache))
            self.forget(old)
            evicted.append(old)
        return evicted

    def forget(self, key: GrammarKey) -> None:
        entry = self._cache.pop(key, None)
        if entry is not None:
            self._cache_bytes -= entry[2]

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    # ---- decoding ---------------------------------------------------------------------------
    def matcher(self, kind: str, value: str) -> Any:
        compiled = self.compile(kind, value)
        return self._xgr.GrammarMatcher(compiled)

    def fill_bitmask(self, matchers: list[Any], drafts: list[list[int]] | None = None) -> Any:
        """An int32 bitmask [rows, words] on the CPU, filled for the rows that have a matcher.

        One buffer, reused step after step (allocating it each step cost more than filling
        it): rows without a matcher hold stale bits, so only the constrained rows may be
        applied (`apply_bitmask` takes their indices).

        `drafts` (speculative decoding): matcher i's row is followed by one row per draft
        token, each filled with the draft before it accepted (the drafts must be ones the
        grammar accepts); the matcher is rolled back after, so it advances only over tokens
        the target model keeps.
        """
        drafts = drafts if drafts is not None else [[] for _ in matchers]
        rows = len(matchers) + sum(len(d) for d in drafts)
        if self._mask is None or self._mask.shape[0] < rows:
            self._mask = self._xgr.allocate_token_bitmask(max(rows, 64), self.vocab_size)
        mask = self._mask[:rows]
        row = 0
        for m, d in zip(matchers, drafts, strict=True):
            if m is None:
                row += 1 + len(d)
                continue
            for j in range(len(d) + 1):
                m.fill_next_token_bitmask(mask, row)
                row += 1
                if j < len(d) and not m.accept_token(d[j]):
                    raise ValueError(f"draft token {d[j]} is not one the grammar accepts")
            if d:
                m.rollback(len(d))
        return mask

    @staticmethod
    def grammar_prefix(matcher: Any, tokens: list[int]) -> list[int]:
        """The leading tokens the matcher accepts, stopping before one that would end the
        grammar (nothing is scored past its end); the matcher is left as it was."""
        taken = n = 0
        for t in tokens:
            if not matcher.accept_token(t):
                break
            taken += 1
            if matcher.is_terminated():
                break
            n += 1
        if taken:
            matcher.rollback(taken)
        return tokens[:n]


def apply_bitmask(logits: Any, bitmask: Any, rows: list[int]) -> None:
    """Disallowed tokens of the constrained `rows` to -inf, in place, with xgrammar's kernel."""
    import xgrammar as xgr

    # A blocking copy: the CPU buffer is refilled at the next step.
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
