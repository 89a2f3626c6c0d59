"""Prometheus metrics of one API server, with the names fixed in ARCHITECTURE.md."""

import logging
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from minisgl.metrics import names
from minisgl.metrics.buckets import (
    ACCEPT_LENGTH_BUCKETS,
    BATCH_SIZE_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    TTFT_BUCKETS,
)
from minisgl.metrics.cumulative import CumulativeDeltas

logger = logging.getLogger(__name__)

_LABEL = "model_name"
# The classic text format generate_latest writes; every Prometheus 2.x and 3.x scrapes it.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _WithoutCreated(Collector):
    """Exposes a registry minus the `*_created` samples prometheus_client adds.

    Those samples would show up as extra `*_created` gauge families; the metric set is a stable
    contract, and switching them off globally (disable_created_metrics) would change other
    registries in the same process.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        for metric in self._registry.collect():
            kept = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            kept.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield kept


class ServerMetrics:
    """All minisgl_* series of one server, in a registry of its own.

    Request-level series are fed by the API server once per finished request
    (`request_finished`); scheduler-level series come from the stats dict the scheduler sends
    (`update_scheduler`), so the numbers are the same whatever the process topology.
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._exposed = _WithoutCreated(self.registry)
        self._deltas = CumulativeDeltas()
        self._warned_reasons: set[str] = set()
        self._warn_lock = threading.Lock()
        reg = self.registry
        lbl = [_LABEL]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, lbl, registry=reg, buckets=buckets).labels(model_name)

        self._ttft = histogram(
            names.TTFT, "Arrival at the API server to the first content chunk.", TTFT_BUCKETS
        )
        self._tpot = histogram(
            names.TPOT,
            "(E2E - TTFT) / (generated tokens - 1), per request with over one token.",
            TOKEN_LATENCY_BUCKETS,
        )
        self._itl = histogram(
            names.ITL, "Time between consecutive streamed content chunks.", TOKEN_LATENCY_BUCKETS
        )
        self._e2e = histogram(
            names.E2E, "Arrival at the API server to the final response.", REQUEST_LATENCY_BUCKETS
        )
        self._queue = histogram(
            names.QUEUE_TIME, "Time a request waited before it was scheduled.",
            REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self._batch = histogram(
            names.BATCH_SIZE, "Requests in each forward step.", BATCH_SIZE_BUCKETS
        )
        self._accept_length = histogram(
            names.SPEC_ACCEPT_LENGTH,
            "Speculative decoding: draft tokens one request kept in one verify step.",
            ACCEPT_LENGTH_BUCKETS,
        )

        self._running = Gauge(
            names.NUM_RUNNING, "Requests in the running batch.", lbl, registry=reg
        ).labels(model_name)
        self._waiting = Gauge(
            names.NUM_WAITING, "Requests waiting to be scheduled.", lbl, registry=reg
        ).labels(model_name)
        self._kv_usage = Gauge(
            names.KV_USAGE, "KV pages held by live requests / all KV pages.", lbl, registry=reg
        ).labels(model_name)
        kv_pages = Gauge(
            names.KV_PAGES, "KV cache pages by state.", [_LABEL, "state"], registry=reg
        )
        self._kv_pages = {s: kv_pages.labels(model_name, s) for s in names.KV_PAGE_STATES}
        self._model_info = Gauge(
            names.MODEL_INFO,
            "1, with the layers' quantization format (none: unquantized), the model dtype, the "
            "LM head's format (none: float) and whether 4-bit weights round their input to 8 "
            "bits (activations: int8) or not (exact), and what the KV cache holds (kv_cache: the "
            "model dtype, or fp8_e4m3).",
            [_LABEL, "quantization", "dtype", "lm_head", "activations", "kv_cache"],
            registry=reg,
        )
        self._weight_bytes = Gauge(
            names.WEIGHT_BYTES, "Bytes of weights the scheduler holds (rank 0's under TP).", lbl,
            registry=reg,
        ).labels(model_name)  # fmt: skip

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, lbl, registry=reg).labels(model_name)

        self._prompt_tokens = counter(names.PROMPT_TOKENS, "Prompt tokens of finished requests.")
        self._generation_tokens = counter(
            names.GENERATION_TOKENS, "Generated tokens of finished requests."
        )
        self._hit_tokens = counter(
            names.PREFIX_CACHE_HIT_TOKENS, "Prompt tokens served from the prefix cache."
        )
        self._preemptions = counter(names.PREEMPTIONS, "Requests preempted for lack of KV pages.")
        requests = Counter(
            names.REQUESTS, "Finished requests by finish reason.", [_LABEL, "finish_reason"],
            registry=reg,
        )  # fmt: skip
        # Every reason exists from the start, so rate() over it works before the first error.
        self._requests = {r: requests.labels(model_name, r) for r in names.FINISH_REASONS}
        self._spec_drafts = counter(
            names.SPEC_DRAFT_TOKENS, "Speculative decoding: draft tokens verified."
        )
        self._spec_accepted = counter(
            names.SPEC_ACCEPTED_TOKENS, "Speculative decoding: draft tokens verified and kept."
        )

    def set_model(
        self,
        quantization: str,
        dtype: str,
        weight_bytes: int,
        *,
        lm_head: str = "none",
        activations: str = "exact",
        kv_cache: str = "",
    ) -> None:
        """What the scheduler loaded, as it reported at start (once)."""
        labels = (quantization, dtype, lm_head, activations, kv_cache or dtype)
        self._model_info.labels(self.model_name, *labels).set(1)
        self._weight_bytes.set(weight_bytes)

    def request_finished(
        self,
        *,
        finish_reason: str,
        prompt_tokens: int,
        generation_tokens: int,
        cached_tokens: int,
        arrival_time: float,
        first_token_time: float | None,
        finish_time: float,
        queue_time: float | None,
        token_times: list[float],
    ) -> None:
        """Observes one finished request; call exactly once per request.

        Times are time.time() at the API server. `cached_tokens` is informational: prefix-cache
        hits are counted from the scheduler's totals, which also see preempted recomputation.
        """
        if prompt_tokens < 0 or generation_tokens < 0:
            raise ValueError(f"negative token count: {prompt_tokens=}, {generation_tokens=}")
        del cached_tokens
        self._requests[self._reason(finish_reason)].inc()
        self._prompt_tokens.inc(prompt_tokens)
        self._generation_tokens.inc(generation_tokens)
        # Wall clocks can step backwards (NTP); a negative latency is never observed.
        e2e = max(0.0, finish_time - arrival_time)
        self._e2e.observe(e2e)
        if queue_time is not None:
            self._queue.observe(max(0.0, queue_time))
        if first_token_time is not None:
            ttft = max(0.0, first_token_time - arrival_time)
            self._ttft.observe(ttft)
            if generation_tokens > 1:
                self._tpot.observe(max(0.0, e2e - ttft) / (generation_tokens - 1))
        for prev, cur in zip(token_times, token_times[1:], strict=False):
            self._itl.observe(max(0.0, cur - prev))

    def update_scheduler(self, stats: Mapping[str, Any]) -> None:
        """Applies one stats report from the scheduler (gauges now, counters from totals)."""
        if "num_running" in stats:
            self._running.set(stats["num_running"])
        if "num_waiting" in stats:
            self._waiting.set(stats["num_waiting"])
        for state in names.KV_PAGE_STATES:
            key = f"num_pages_{state}"
            if key in stats:
                self._kv_pages[state].set(stats[key])
        total = stats.get("num_pages_total")
        if total and "num_pages_used" in stats:
            self._kv_usage.set(stats["num_pages_used"] / total)
        if "num_preemptions_total" in stats:
            self._preemptions.inc(self._deltas.delta("preemptions", stats["num_preemptions_total"]))
        if "prefix_cache_hit_tokens_total" in stats:
            hits = self._deltas.delta("prefix_hits", stats["prefix_cache_hit_tokens_total"])
            self._hit_tokens.inc(hits)
        # prompt_tokens_total and last_batch_size are accepted but not exported: prompt tokens
        # are counted from the responses' usage (so they match what clients were told), and
        # batch sizes arrive in full through batch_sizes.
        for size in stats.get("batch_sizes") or ():
            self._batch.observe(size)
        if "spec_draft_tokens_total" in stats:
            drafts = self._deltas.delta("spec_drafts", stats["spec_draft_tokens_total"])
            self._spec_drafts.inc(drafts)
        if "spec_accepted_tokens_total" in stats:
            kept = self._deltas.delta("spec_accepted", stats["spec_accepted_tokens_total"])
            self._spec_accepted.inc(kept)
        # Verifies since the last report, counted by how many drafts they kept (index = kept).
        for kept, count in enumerate(stats.get("spec_accept_lengths") or ()):
            for _ in range(count):
                self._accept_length.observe(kept)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of this server's series, and its content type."""
        return generate_latest(self._exposed), CONTENT_TYPE

    def _reason(self, finish_reason: str) -> str:
        if finish_reason in self._requests:
            return finish_reason
        with self._warn_lock:
            if finish_reason not in self._warned_reasons:
                self._warned_reasons.add(finish_reason)
                logger.warning("unknown finish_reason %r counted as 'error'", finish_reason)
        return "error"
