"""ServerMetrics: exact names, types, labels and accounting of its exposition."""

import math

import pytest
from metrics_text import parse, value

from minisgl.metrics import ServerMetrics
from minisgl.metrics import names as n
from minisgl.metrics.cumulative import CumulativeDeltas

MODEL = "qwen-test"


def finish(m: ServerMetrics, **kw: object) -> None:
    args: dict[str, object] = dict(
        finish_reason="stop",
        prompt_tokens=10,
        generation_tokens=4,
        cached_tokens=0,
        arrival_time=100.0,
        first_token_time=100.5,
        finish_time=102.0,
        queue_time=0.25,
        token_times=[100.5, 101.0, 101.5, 102.0],
    )
    args.update(kw)
    m.request_finished(**args)  # type: ignore[arg-type]


def test_exposes_exactly_the_architecture_metric_set() -> None:
    m = ServerMetrics(MODEL)
    body, ctype = m.render()
    assert ctype.startswith("text/plain")
    fams = parse(body)
    expected = {name: "histogram" for name in n.HISTOGRAMS}
    expected |= {name: "gauge" for name in n.GAUGES}
    expected |= {name: "counter" for name in n.COUNTERS}
    assert {name: typ for name, (typ, _) in fams.items()} == expected
    for name, (_, samples) in fams.items():
        for s in samples:
            assert s.labels["model_name"] == MODEL, s
            extra = set(s.labels) - {"model_name", "le"}
            if name == n.KV_PAGES:
                assert extra == {"state"}
            elif name == n.REQUESTS:
                assert extra == {"finish_reason"}
            else:
                assert not extra, s
    states = {s.labels["state"] for s in fams[n.KV_PAGES][1]}
    assert states == {"free", "used", "cached"}
    reasons = {s.labels["finish_reason"] for s in fams[n.REQUESTS][1]}
    assert reasons == {"stop", "length", "abort", "error"}


def test_histogram_buckets_span_cpu_and_gpu() -> None:
    fams = parse(ServerMetrics(MODEL).render()[0])

    def bounds(name: str) -> list[float]:
        return [float(s.labels["le"]) for s in fams[name][1] if s.name.endswith("_bucket")]

    ttft = bounds(n.TTFT)
    assert ttft[0] <= 0.001 and max(b for b in ttft if b != math.inf) > 60
    for name in (n.ITL, n.TPOT):
        itl = bounds(name)
        assert itl[0] <= 0.001 and 10 in itl
    batch = bounds(n.BATCH_SIZE)
    assert batch[0] == 1 and 512 in batch


def test_request_is_observed_once_with_exact_latencies() -> None:
    m = ServerMetrics(MODEL)
    finish(m)
    body = m.render()[0]
    assert value(body, n.TTFT + "_count") == 1
    assert value(body, n.TTFT + "_sum") == pytest.approx(0.5)
    assert value(body, n.E2E + "_count") == 1
    assert value(body, n.E2E + "_sum") == pytest.approx(2.0)
    # TPOT = (E2E - TTFT) / (4 - 1) = 0.5
    assert value(body, n.TPOT + "_count") == 1
    assert value(body, n.TPOT + "_sum") == pytest.approx(0.5)
    assert value(body, n.QUEUE_TIME + "_sum") == pytest.approx(0.25)
    assert value(body, n.ITL + "_count") == 3
    assert value(body, n.ITL + "_sum") == pytest.approx(1.5)
    # 0.5 s lands in le=0.5 and above, not below.
    assert value(body, n.TTFT + "_bucket", le="0.5") == 1
    assert value(body, n.TTFT + "_bucket", le="0.4") == 0
    assert value(body, n.PROMPT_TOKENS) == 10
    assert value(body, n.GENERATION_TOKENS) == 4
    assert value(body, n.REQUESTS, finish_reason="stop") == 1
    assert value(body, n.REQUESTS, finish_reason="length") == 0


def test_token_counters_sum_usage_over_many_requests() -> None:
    m = ServerMetrics(MODEL)
    usage = [(7, 1, "length"), (3, 9, "stop"), (12, 0, "abort"), (5, 2, "error"), (1, 30, "length")]
    for prompt, gen, reason in usage:
        finish(m, prompt_tokens=prompt, generation_tokens=gen, finish_reason=reason)
    body = m.render()[0]
    assert value(body, n.PROMPT_TOKENS) == sum(u[0] for u in usage)
    assert value(body, n.GENERATION_TOKENS) == sum(u[1] for u in usage)
    assert value(body, n.REQUESTS, finish_reason="length") == 2
    assert value(body, n.REQUESTS, finish_reason="abort") == 1
    assert value(body, n.E2E + "_count") == len(usage)
    # TPOT is defined only with more than one generated token.
    assert value(body, n.TPOT + "_count") == 3


def test_request_without_first_token_or_queue_time() -> None:
    m = ServerMetrics(MODEL)
    finish(m, first_token_time=None, queue_time=None, generation_tokens=0, token_times=[],
           finish_reason="error")  # fmt: skip
    body = m.render()[0]
    assert value(body, n.E2E + "_count") == 1
    assert value(body, n.TTFT + "_count") == 0
    assert value(body, n.TPOT + "_count") == 0
    assert value(body, n.QUEUE_TIME + "_count") == 0
    assert value(body, n.ITL + "_count") == 0


def test_unknown_finish_reason_counts_as_error_and_clock_steps_are_clamped() -> None:
    m = ServerMetrics(MODEL)
    finish(m, finish_reason="tool_calls", finish_time=99.0)
    body = m.render()[0]
    assert value(body, n.REQUESTS, finish_reason="error") == 1
    assert value(body, n.E2E + "_sum") == 0
    with pytest.raises(ValueError):
        finish(m, prompt_tokens=-1)


STATS = dict(
    num_running=3,
    num_waiting=5,
    num_pages_total=100,
    num_pages_free=60,
    num_pages_used=25,
    num_pages_cached=15,
    num_preemptions_total=2,
    prefix_cache_hit_tokens_total=40,
    prompt_tokens_total=400,
    last_batch_size=3,
    batch_sizes=[1, 2, 3, 3],
)


def test_scheduler_gauges_and_batch_sizes() -> None:
    m = ServerMetrics(MODEL)
    m.update_scheduler(STATS)
    body = m.render()[0]
    assert value(body, n.NUM_RUNNING) == 3
    assert value(body, n.NUM_WAITING) == 5
    assert value(body, n.KV_USAGE) == pytest.approx(0.25)
    assert value(body, n.KV_PAGES, state="free") == 60
    assert value(body, n.KV_PAGES, state="used") == 25
    assert value(body, n.KV_PAGES, state="cached") == 15
    assert value(body, n.BATCH_SIZE + "_count") == 4
    assert value(body, n.BATCH_SIZE + "_sum") == 9
    assert value(body, n.BATCH_SIZE + "_bucket", le="2.0") == 2
    # Gauges follow the latest report; a report without batches observes nothing.
    m.update_scheduler({**STATS, "num_running": 0, "num_pages_used": 0, "batch_sizes": []})
    body = m.render()[0]
    assert value(body, n.NUM_RUNNING) == 0
    assert value(body, n.KV_USAGE) == 0
    assert value(body, n.BATCH_SIZE + "_count") == 4


def test_scheduler_totals_become_counter_increments_across_restarts() -> None:
    m = ServerMetrics(MODEL)
    m.update_scheduler(STATS)  # first report counts in full
    m.update_scheduler({**STATS, "num_preemptions_total": 5, "prefix_cache_hit_tokens_total": 70})
    m.update_scheduler({**STATS, "num_preemptions_total": 5, "prefix_cache_hit_tokens_total": 70})
    body = m.render()[0]
    assert value(body, n.PREEMPTIONS) == 5
    assert value(body, n.PREFIX_CACHE_HIT_TOKENS) == 70
    # The scheduler restarted and counts from zero again: nothing is lost or subtracted.
    m.update_scheduler({**STATS, "num_preemptions_total": 1, "prefix_cache_hit_tokens_total": 8})
    body = m.render()[0]
    assert value(body, n.PREEMPTIONS) == 6
    assert value(body, n.PREFIX_CACHE_HIT_TOKENS) == 78
    # Prompt tokens come from the responses' usage, not the scheduler.
    assert value(body, n.PROMPT_TOKENS) == 0


def test_speculative_counters_and_accept_lengths() -> None:
    m = ServerMetrics(MODEL)
    body = m.render()[0]  # exposed at 0 before any speculation, so rate() works at once
    assert value(body, n.SPEC_DRAFT_TOKENS) == 0
    assert value(body, n.SPEC_ACCEPT_LENGTH + "_count") == 0
    # 6 verifies: 2 kept nothing, 1 kept 1, 3 kept all 4 drafts (counts indexed by kept).
    lengths = [2, 1, 0, 0, 3]
    m.update_scheduler(
        {"spec_draft_tokens_total": 24, "spec_accepted_tokens_total": 13,
         "spec_accept_lengths": lengths}
    )  # fmt: skip
    m.update_scheduler({"spec_draft_tokens_total": 30, "spec_accepted_tokens_total": 15})
    body = m.render()[0]
    assert value(body, n.SPEC_DRAFT_TOKENS) == 30
    assert value(body, n.SPEC_ACCEPTED_TOKENS) == 15
    assert value(body, n.SPEC_ACCEPT_LENGTH + "_count") == 6
    assert value(body, n.SPEC_ACCEPT_LENGTH + "_sum") == 13
    assert value(body, n.SPEC_ACCEPT_LENGTH + "_bucket", le="0.0") == 2
    assert value(body, n.SPEC_ACCEPT_LENGTH + "_bucket", le="3.0") == 3
    assert value(body, n.SPEC_ACCEPT_LENGTH + "_bucket", le="4.0") == 6
    # A restarted scheduler counts from zero again: its totals add on.
    m.update_scheduler({"spec_draft_tokens_total": 4, "spec_accepted_tokens_total": 4})
    body = m.render()[0]
    assert value(body, n.SPEC_DRAFT_TOKENS) == 34
    assert value(body, n.SPEC_ACCEPTED_TOKENS) == 19


def test_tpot_is_per_output_token_when_chunks_carry_several() -> None:
    """A verify step may emit several tokens at once: TPOT still divides by tokens, not by
    the chunks (here 9 tokens in 3 chunks after the first: (e2e - ttft) / 8, not / 3)."""
    m = ServerMetrics(MODEL)
    finish(m, generation_tokens=9, token_times=[100.5, 101.0, 101.5, 102.0])
    body = m.render()[0]
    assert value(body, n.TPOT + "_count") == 1
    assert value(body, n.TPOT + "_sum") == pytest.approx(1.5 / 8)
    assert value(body, n.ITL + "_count") == 3  # one gap per chunk


def test_two_servers_in_one_process_do_not_share_series() -> None:
    a, b = ServerMetrics("a"), ServerMetrics("b")
    finish(a)
    assert value(a.render()[0], n.E2E + "_count", model_name="a") == 1
    assert value(b.render()[0], n.E2E + "_count", model_name="b") == 0
    assert 'model_name="b"' not in a.render()[0].decode()


def test_cumulative_deltas() -> None:
    d = CumulativeDeltas()
    assert [d.delta("k", t) for t in (3, 3, 10, 2, 4)] == [3, 0, 7, 2, 2]
    assert d.delta("other", 5) == 5
    with pytest.raises(ValueError):
        d.delta("k", -1)
