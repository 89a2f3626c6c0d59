"""`python -m minisgl_operator [--namespace NS] [--prometheus-url URL]`: run the operator."""

from __future__ import annotations

import argparse
import logging

import kopf

from minisgl_operator import handlers
from minisgl_operator.reconcile import Config


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minisgl_operator", description=__doc__)
    p.add_argument("--namespace", help="watch only this namespace (default: all namespaces)")
    p.add_argument(
        "--prometheus-url",
        help="Prometheus base URL: KEDA's default query target and source of status.observed",
    )
    p.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        help="kopf liveness endpoint ('' to disable)",
    )
    p.add_argument("--verbose", action="store_true", help="debug logging")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    handlers.CONFIG = Config(prometheus_url=args.prometheus_url)
    kopf.run(
        clusterwide=args.namespace is None,
        namespaces=[args.namespace] if args.namespace else (),
        standalone=True,  # one replica; no kopf peering objects (and no RBAC for them)
        liveness_endpoint=args.liveness or None,
    )


if __name__ == "__main__":
    main()
