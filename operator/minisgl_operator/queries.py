"""PromQL over minisgl's metrics (names fixed in ARCHITECTURE.md), shared by the autoscalers
and the status timer so that what scales a ModelServer is exactly what its status shows.
"""

from __future__ import annotations

import re

from minisgl_operator import MODELSERVER_LABEL

TTFT_HISTOGRAM = "minisgl_time_to_first_token_seconds"
TPOT_HISTOGRAM = "minisgl_time_per_output_token_seconds"
WAITING_GAUGE = "minisgl_num_requests_waiting"
RUNNING_GAUGE = "minisgl_num_requests_running"
KV_USAGE_GAUGE = "minisgl_kv_cache_usage_ratio"  # 0..1, what the endpoint picker expects
WINDOW = "2m"

# Per-pod metrics that prometheus-adapter serves for the HPA fallback; the rules that make
# them are charts/minisgl/files/prometheus-adapter-values.yaml (a test keeps the two in step).
ADAPTER_TTFT_P95 = "minisgl_ttft_p95_seconds"
ADAPTER_TPOT_P95 = "minisgl_tpot_p95_seconds"
ADAPTER_WAITING = WAITING_GAUGE


# The ModelServer a series came from: its pods' label minisgl.io/modelserver, copied onto every
# series as Prometheus names a pod label (non-alphanumerics to "_"). The chart's PodMonitor and
# ServiceMonitor copy it (podTargetLabels), and so does the usual annotation-driven pods job
# (labelmap __meta_kubernetes_pod_label_(.+)). A ModelServer's SLOs are its own pods' only:
# two ModelServers in one namespace may serve the same model name.
SERIES_MODELSERVER_LABEL = re.sub(r"[^a-zA-Z0-9_]", "_", MODELSERVER_LABEL)


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def selector(namespace: str, modelserver: str) -> str:
    """The series of one ModelServer's pods."""
    ms = f"{SERIES_MODELSERVER_LABEL}={_quote(modelserver)}"
    return "{" + f"namespace={_quote(namespace)},{ms}" + "}"


def p95(histogram: str, namespace: str, modelserver: str) -> str:
    sel = selector(namespace, modelserver)
    return f"histogram_quantile(0.95, sum by (le) (rate({histogram}_bucket{sel}[{WINDOW}])))"


def ttft_p95(namespace: str, modelserver: str) -> str:
    return p95(TTFT_HISTOGRAM, namespace, modelserver)


def tpot_p95(namespace: str, modelserver: str) -> str:
    return p95(TPOT_HISTOGRAM, namespace, modelserver)


def waiting_total(namespace: str, modelserver: str) -> str:
    return f"sum({WAITING_GAUGE}{selector(namespace, modelserver)})"


def or_zero(query: str) -> str:
    """No traffic makes histogram_quantile NaN; an autoscaler should read that as 0, not fail."""
    return f"({query} > 0) or vector(0)"
