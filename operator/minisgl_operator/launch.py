"""What a ModelServer pod runs: the `python -m minisgl` command line and the timings around it.

Flags are rendered through `minisgl.config` (ServerArgs + to_cli_args), so minisgl's own
defaults are never repeated here, and the full command line is parsed back with minisgl's
parser: a bad `extraArgs` becomes a Degraded condition instead of a crash-looping pod.
"""

from __future__ import annotations

import contextlib
import io
import math
from dataclasses import dataclass
from typing import Any

from minisgl.config import ServerArgs, build_parser, flag_name, to_cli_args
from minisgl_operator.node_security import SECRET_FILE
from minisgl_operator.spec import ModelServerSpec, SpecError

LAUNCHER = ["python", "-m", "minisgl"]
LISTEN_HOST = "0.0.0.0"  # the pod's IP, not loopback: the Service must reach it
# Seconds the pod keeps serving after it is marked terminating, so that endpoint removal reaches
# every proxy before the server stops accepting (otherwise some requests hit a closed port).
PRESTOP_SLEEP_S = 5
# Slack on top of preStop + drain before the kubelet's SIGKILL.
GRACE_MARGIN_S = 10
STARTUP_PROBE_PERIOD_S = 10

# Flags the operator owns: set from typed spec fields, never through extraArgs.
MANAGED_FIELDS = (
    "model",
    "served_model_name",
    "host",
    "port",
    "device",
    "dtype",
    "quantization",
    "lm_head_quantization",
    "kv_cache_dtype",
    "tp_size",
    "nnodes",
    "node_rank",
    "num_pages",
    "max_seq_len_override",
    "max_running_requests",
    "shutdown_timeout",
    "speculative_algorithm",
    "speculative_num_draft_tokens",
    "speculative_draft_model_path",
)


# Multi-node (engine.nodes > 1): the rendezvous port on the leader pod, and the flags each pod
# of a LeaderWorkerSet group adds. Kubernetes expands $(VAR) in a container's command from its
# environment, where LeaderWorkerSet puts the group's leader address and the pod's index.
DIST_INIT_PORT = 29500
LWS_LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
LWS_WORKER_INDEX = "LWS_WORKER_INDEX"


def multi_node_args() -> list[str]:
    """Per pod, so outside what the operator parses: Kubernetes fills them in."""
    return [
        "--node-rank",
        f"$({LWS_WORKER_INDEX})",
        "--dist-init-addr",
        f"$({LWS_LEADER_ADDRESS}):{DIST_INIT_PORT}",
    ]


@dataclass(frozen=True)
class Launch:
    args: list[str]  # everything after `python -m minisgl`
    server: ServerArgs  # what the server will run with, defaults included
    termination_grace_s: int
    startup_failure_threshold: int

    nodes: int = 1

    @property
    def command(self) -> list[str]:
        """What every pod runs; in a multi-node group each pod adds its rank (node 0 is the
        leader, which also serves the API)."""
        extra = multi_node_args() if self.nodes > 1 else []
        return [*LAUNCHER, *self.args, *extra]

    @property
    def port(self) -> int:
        return self.server.port


def server_args(spec: ModelServerSpec) -> ServerArgs:
    """Typed spec fields -> ServerArgs; fields the spec leaves out keep minisgl's defaults."""
    e = spec.engine
    spec_dec = e.speculative
    given: dict[str, Any] = {
        "served_model_name": spec.served_model_name,
        "dtype": e.dtype,
        "quantization": e.quantization,
        "lm_head_quantization": e.lm_head_quantization,
        "kv_cache_dtype": e.kv_cache_dtype,
        "num_pages": e.num_pages,
        "max_seq_len_override": e.max_seq_len,
        "max_running_requests": e.max_running_requests,
        "shutdown_timeout": float(e.shutdown_timeout_s) if e.shutdown_timeout_s else None,
        "speculative_algorithm": spec_dec.algorithm if spec_dec else None,
        "speculative_num_draft_tokens": spec_dec.num_draft_tokens if spec_dec else None,
        "speculative_draft_model_path": spec_dec.draft_model_path if spec_dec else None,
        # The group's secret, mounted into every pod (node_security).
        "node_secret_file": SECRET_FILE if e.multi_node else None,
    }
    return ServerArgs(
        model=spec.model,
        host=LISTEN_HOST,
        device="cuda" if spec.resources.gpus > 0 else "cpu",
        tp_size=e.tensor_parallel_size,
        nnodes=e.nodes,
        **{k: v for k, v in given.items() if v is not None},
    )


def _parse(argv: list[str], *, explicit_only: bool = False) -> dict[str, Any]:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = build_parser(explicit_only=explicit_only).parse_args(argv)
    except SystemExit:
        last = err.getvalue().strip().splitlines()
        raise SpecError(f"engine flags rejected: {last[-1] if last else 'invalid'}") from None
    return vars(ns)


def launch(spec: ModelServerSpec) -> Launch:
    extra = list(spec.engine.extra_args)
    # What the parser resolves the extra flags to, not how they are spelled (`--tp-size=4`).
    group = ("dist_init_addr", "node_secret_file")
    managed = MANAGED_FIELDS + (group if spec.engine.multi_node else ())
    owned = [f for f in managed if f in _parse(extra, explicit_only=True)]
    if owned:
        names = ", ".join(flag_name(f) for f in owned)
        raise SpecError(f"engine.extraArgs may not set {names}: use the spec field")
    args = to_cli_args(server_args(spec)) + extra
    server = ServerArgs(**_parse(args))
    grace = PRESTOP_SLEEP_S + math.ceil(server.shutdown_timeout) + GRACE_MARGIN_S
    failures = max(1, math.ceil(spec.startup_timeout_s / STARTUP_PROBE_PERIOD_S))
    return Launch(args, server, grace, failures, spec.engine.nodes)
