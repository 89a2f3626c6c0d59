"""Observed SLO metrics of a ModelServer, read from Prometheus' HTTP API for its status."""

from __future__ import annotations

import math
from typing import Any

import httpx

from minisgl_operator import queries
from minisgl_operator.spec import ModelServerSpec

TIMEOUT_S = 5.0


def first_value(payload: dict[str, Any]) -> float | None:
    """The first sample of an instant-query answer; None for no data or NaN (no traffic)."""
    if payload.get("status") != "success":
        return None
    result = (payload.get("data") or {}).get("result") or []
    if not result:
        return None
    try:
        value = float(result[0]["value"][1])
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    return None if math.isnan(value) or math.isinf(value) else value


async def query(client: httpx.AsyncClient, base_url: str, promql: str) -> float | None:
    resp = await client.get(
        base_url.rstrip("/") + "/api/v1/query", params={"query": promql}, timeout=TIMEOUT_S
    )
    resp.raise_for_status()
    return first_value(resp.json())


async def observe(
    client: httpx.AsyncClient, base_url: str, spec: ModelServerSpec
) -> dict[str, Any]:
    """status.observed: TTFT p95, TPOT p95 (seconds) and waiting requests, absent when unknown."""
    ns, name = spec.namespace, spec.name
    wanted = {
        "ttftP95Seconds": queries.ttft_p95(ns, name),
        "tpotP95Seconds": queries.tpot_p95(ns, name),
        "waitingRequests": queries.waiting_total(ns, name),
    }
    out: dict[str, Any] = {}
    for key, promql in wanted.items():
        value = await query(client, base_url, promql)
        # None (not 0) so a merge patch clears a stale number once traffic stops.
        out[key] = None if value is None else round(value, 4)
    return out
