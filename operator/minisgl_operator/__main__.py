"""`python -m minisgl_operator [--namespace NS] [--prometheus-url URL] [--epp-image IMAGE]
[--epp-arg FLAG ...]`: run the operator."""

from __future__ import annotations

import argparse
import logging

import kopf

from minisgl_operator import handlers
from minisgl_operator.reconcile import Config
from minisgl_operator.routing import DEFAULT_EPP_IMAGE, PickerConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minisgl_operator", description=__doc__)
    p.add_argument("--namespace", help="watch only this namespace (default: all namespaces)")
    p.add_argument(
        "--prometheus-url",
        help="Prometheus base URL: KEDA's default query target and source of status.observed",
    )
    p.add_argument(
        "--epp-image",
        default=DEFAULT_EPP_IMAGE,
        help="endpoint picker image for ModelServers with spec.routing.inferencePool",
    )
    p.add_argument(
        "--epp-arg",
        action="append",
        default=[],
        metavar="WORD",
        help="one more word of the endpoint picker's command line (repeat for each word)",
    )
    p.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        help="kopf liveness endpoint ('' to disable)",
    )
    p.add_argument("--verbose", action="store_true", help="debug logging")
    return p


# Client libraries that log every HTTP request at INFO (httpx: a line per Kubernetes API call,
# several per child per reconcile): at that level they drown the operator's own events.
LIBRARY_LOGGERS = ("httpx", "httpcore", "kubernetes", "urllib3")


def configure_logging(verbose: bool) -> None:
    level = logging.DEBUG if verbose else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.WARNING)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose)
    picker = PickerConfig(image=args.epp_image, extra_args=tuple(args.epp_arg))
    handlers.CONFIG = Config(prometheus_url=args.prometheus_url, picker=picker)
    handlers.WATCH_NAMESPACE = args.namespace
    kopf.run(
        clusterwide=args.namespace is None,
        namespaces=[args.namespace] if args.namespace else (),
        standalone=True,  # one replica; no kopf peering objects (and no RBAC for them)
        liveness_endpoint=args.liveness or None,
    )


if __name__ == "__main__":
    main()
