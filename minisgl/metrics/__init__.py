"""Prometheus metrics of the minisgl server (names fixed in ARCHITECTURE.md, "Metrics")."""

from minisgl.metrics.server_metrics import ServerMetrics

__all__ = ["ServerMetrics"]
