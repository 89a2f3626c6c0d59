"""A real Prometheus scraping a live minisgl: dashboards and recording rules see the burst.

The server speculates (ngram) on a model that copies (minisgl/testing/copy_model.py), so the
speculative-decoding series and the dashboard's acceptance panel have data too."""

import asyncio
from pathlib import Path

import httpx
import openai
import yaml
from dashboard_queries import queries
from live_processes import (
    minisgl_server,
    prometheus,
    query,
    scalar,
    wait_for,
    wait_nonempty,
)
from metrics_text import parse, value
from promtool import RULES_FILE, binary

from minisgl.bench.cli import build_parser, run
from minisgl.metrics import names as n

MODEL = "tiny-live"
SEL = f'{{model_name="{MODEL}"}}'
NUM_PAGES = 512
STREAMED = 6  # through the benchmark client, 3 at a time
OUTPUT_LEN = 8
COPY_LEN = 24  # tokens the copy requests generate
SEED_PROMPT = "Repeat after me: one two three four"


async def _non_streamed(base: str) -> list[dict]:
    """Chat and completions without streaming; the same prompt twice hits the prefix cache."""
    prompt = "one two three four five six seven eight nine ten eleven twelve " * 4
    bodies = [
        ("/v1/completions", {"prompt": prompt}),
        ("/v1/completions", {"prompt": prompt}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello there"}]}),
    ]
    async with httpx.AsyncClient(timeout=120.0) as client:
        out = []
        for path, body in bodies:
            body |= {"model": MODEL, "max_tokens": OUTPUT_LEN, "ignore_eos": True}
            resp = await client.post(base + path, json=body)
            assert resp.status_code == 200, resp.text
            out.append(resp.json()["usage"])
        return out


def _copied(base: str) -> list[dict]:
    """Through the openai client: the model's continuation of SEED_PROMPT, then a prompt that
    holds it and ends like SEED_PROMPT, whose continuation (the model copies) is that text again,
    so ngram drafts taken from the prompt are kept. Both usages (output tokens, not drafts)."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    extra = {"ignore_eos": True}
    first = client.completions.create(
        model=MODEL, prompt=SEED_PROMPT, max_tokens=COPY_LEN, temperature=0, extra_body=extra
    )
    text = first.choices[0].text
    again = client.completions.create(
        model=MODEL,
        prompt=f"{SEED_PROMPT}{text}\n{SEED_PROMPT}",
        max_tokens=COPY_LEN,
        temperature=0,
        extra_body=extra,
    )
    assert again.choices[0].text == text  # greedy, with drafts verified: the same text
    usages = [first.usage, again.usage]
    assert all(u is not None and u.completion_tokens == COPY_LEN for u in usages)
    return [u.model_dump() for u in usages if u is not None]


def test_dashboards_and_rules_have_data_and_counts_match(tmp_path: Path) -> None:
    prom_bin = binary("prometheus")
    # The fixture model is written lazily so the skip above costs nothing.
    from minisgl.testing.copy_model import write_copy_model
    from minisgl.testing.fixture import write_fixture_model

    model_dir = write_copy_model(write_fixture_model(tmp_path / "model", "tiny"), tmp_path / "cp")
    # Drafts every step: whether they pay on the tiny model must not decide what is tested.
    flags = (
        "--num-pages",
        str(NUM_PAGES),
        "--speculative-algorithm",
        "ngram",
        "--disable-speculative-adaptive",
    )
    with (
        minisgl_server(model_dir, MODEL, tmp_path, *flags) as base,
        prometheus(
            prom_bin,
            base.removeprefix("http://"),
            tmp_path,
            [RULES_FILE],
            {"pod": "minisgl-live-0", "namespace": "live"},
        ) as prom,  # fmt: skip
    ):
        # Counters must be seen at zero before the burst, or rate() finds no increase.
        assert wait_nonempty(prom, 'count_over_time(up{job="minisgl"}[1m]) >= 2')
        args = build_parser().parse_args(
            ["--base-url", base, "--num-prompts", str(STREAMED), "--max-concurrency", "3",
             "--random-input-len", "24", "--random-output-len", str(OUTPUT_LEN),
             "--warmup-requests", "0", "--disable-tqdm"]
        )  # fmt: skip
        record = run(args)
        assert record["completed"] == STREAMED and record["failed"] == 0, record["errors"]
        usages = asyncio.run(_non_streamed(base))
        copies = _copied(base)
        sent = STREAMED + len(usages) + len(copies)
        usages += copies
        prompt_tokens = record["total_input_tokens"] + sum(u["prompt_tokens"] for u in usages)
        gen_tokens = record["total_output_tokens"] + sum(u["completion_tokens"] for u in usages)
        asked = (sent - len(copies)) * OUTPUT_LEN + len(copies) * COPY_LEN
        assert gen_tokens == asked
        metrics = httpx.get(base + "/metrics", timeout=10.0)
        assert metrics.headers["content-type"].startswith("text/plain")
        assert set(parse(metrics.content)) == set(n.HISTOGRAMS) | set(n.GAUGES) | set(n.COUNTERS)

        # Exact accounting, as Prometheus scraped it.
        assert wait_for(prom, f"sum({n.REQUESTS}{SEL})", sent) == sent
        for hist in (n.TTFT, n.E2E, n.QUEUE_TIME, n.TPOT):
            assert wait_for(prom, f"{hist}_count{SEL}", sent) == sent, hist
        assert scalar(prom, f'{n.REQUESTS}{{model_name="{MODEL}",finish_reason="length"}}') == sent
        assert scalar(prom, f"{n.PROMPT_TOKENS}{SEL}") == prompt_tokens
        assert scalar(prom, f"{n.GENERATION_TOKENS}{SEL}") == gen_tokens
        # One gap per content chunk after the first: at most one per token after the first.
        itl_count = scalar(prom, f"{n.ITL}_count{SEL}")
        assert itl_count is not None and 0 < itl_count <= asked - sent
        # Scheduler-side series travel in periodic stats messages, a scrape or two behind the
        # API server's own: wait for them rather than read them once.
        # Every request ran in at least one forward step.
        assert wait_nonempty(prom, f"{n.BATCH_SIZE}_sum{SEL} >= {sent}")
        assert wait_nonempty(prom, f"sum({n.KV_PAGES}{SEL}) == {NUM_PAGES}")
        # The repeated prompt reused cached KV pages.
        assert wait_nonempty(prom, f"{n.PREFIX_CACHE_HIT_TOKENS}{SEL} > 0")
        # Drafts were verified, and the copy kept some: on /metrics and as Prometheus saw them.
        assert wait_nonempty(prom, f"{n.SPEC_ACCEPTED_TOKENS}{SEL} > 0")
        body = httpx.get(base + "/metrics", timeout=10.0).content
        drafted, kept = value(body, n.SPEC_DRAFT_TOKENS), value(body, n.SPEC_ACCEPTED_TOKENS)
        assert drafted >= kept > 0
        assert value(body, n.SPEC_ACCEPT_LENGTH + "_sum") == kept
        assert value(body, n.SPEC_ACCEPT_LENGTH + "_count") > 0

        # Every recording rule and every dashboard query returns data.
        rules = yaml.safe_load(RULES_FILE.read_text())["groups"]
        records = [r["record"] for g in rules for r in g["rules"] if "record" in r]
        for rec in records:
            # NaN (no traffic in the window yet) is no data; wait for the burst to reach the rule.
            (series,) = wait_nonempty(prom, f"{rec} >= 0")
            assert (
                series["metric"]["model_name"] == MODEL and series["metric"]["namespace"] == "live"
            )
        no_data = [title for title, expr in queries() if not query(prom, f"({expr}) >= 0")]
        assert not no_data, f"dashboard queries without data: {no_data}"
        ttft_p95 = scalar(
            prom, "namespace_modelserver_model_name:minisgl_time_to_first_token_seconds:p95_1m"
        )
        assert ttft_p95 is not None and 0 < ttft_p95 < 60
