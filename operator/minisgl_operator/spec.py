"""ModelServer spec -> a typed, validated `ModelServerSpec` (or a `SpecError` to report).

The API server applies the CRD's defaults and checks its schema and CEL rules, but the operator
checks again: a cluster may run without CEL, and unit tests pass raw dicts. Defaults, bounds
and enums come from `schema`, the same declaration the CRD is rendered from.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from minisgl_operator.schema import (
    MAX_MULTI_NODE_NAME_LEN,
    MAX_NAME_LEN,
    QUANTITY_PATTERN,
    SPEC,
    TOLERATION_EFFECTS,
    TOLERATION_OPERATORS,
)

DEFAULT_IMAGE: str = SPEC.at("image").default
DEFAULT_REPLICAS: int = SPEC.at("replicas").default
DEFAULT_STARTUP_TIMEOUT_S: int = SPEC.at("startupTimeoutSeconds").default
DEFAULT_TP_SIZE: int = SPEC.at("engine.tensorParallelSize").default
DEFAULT_NODES: int = SPEC.at("engine.nodes").default
DEFAULT_CACHE_SIZE: str = SPEC.at("modelCache.size").default
DEFAULT_MIN_REPLICAS: int = SPEC.at("autoscaling.minReplicas").default
DEFAULT_TARGETS: dict[str, float] = SPEC.at("autoscaling.targets").default
DEFAULT_SCALE_UP_STABILIZATION_S: int = SPEC.at("autoscaling.scaleUpStabilizationSeconds").default
DEFAULT_SCALE_DOWN_STABILIZATION_S: int = SPEC.at(
    "autoscaling.scaleDownStabilizationSeconds"
).default

_TOLERATION_EFFECTS = (None, "", *TOLERATION_EFFECTS)
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_FROM_SCHEMA: Any = object()
__all__ = ["MAX_NAME_LEN", "ModelServerSpec", "SpecError", "parse_spec"]


class SpecError(ValueError):
    """The spec cannot be served as written; the message is shown in the Degraded condition."""


@dataclass(frozen=True)
class SpeculativeSpec:
    algorithm: str
    num_draft_tokens: int | None = None  # None: minisgl's own default
    draft_model_path: str | None = None


@dataclass(frozen=True)
class EngineSpec:
    dtype: str | None = None
    quantization: str | None = None
    lm_head_quantization: str | None = None
    kv_cache_dtype: str | None = None
    tensor_parallel_size: int = DEFAULT_TP_SIZE
    nodes: int = DEFAULT_NODES
    num_pages: int | None = None
    max_seq_len: int | None = None
    max_running_requests: int | None = None
    shutdown_timeout_s: int | None = None
    speculative: SpeculativeSpec | None = None
    extra_args: tuple[str, ...] = ()

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nodes


@dataclass(frozen=True)
class ResourcesSpec:
    gpus: int = DEFAULT_TP_SIZE
    cpu: str | None = None
    memory: str | None = None
    shared_memory: str | None = None


@dataclass(frozen=True)
class CacheSpec:
    size: str = DEFAULT_CACHE_SIZE
    storage_class_name: str | None = None
    existing_claim: str | None = None


@dataclass(frozen=True)
class Targets:
    ttft_p95_s: float | None = None
    tpot_p95_s: float | None = None
    waiting_per_replica: float | None = None


@dataclass(frozen=True)
class AutoscalingSpec:
    min_replicas: int
    max_replicas: int
    targets: Targets
    scale_up_stabilization_s: int = DEFAULT_SCALE_UP_STABILIZATION_S
    scale_down_stabilization_s: int = DEFAULT_SCALE_DOWN_STABILIZATION_S
    prometheus_url: str | None = None


@dataclass(frozen=True)
class IngressSpec:
    host: str
    class_name: str | None = None
    tls: bool = False
    annotations: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class GatewayRef:
    name: str
    namespace: str


@dataclass(frozen=True)
class RoutingSpec:
    inference_pool: bool = False
    gateway: GatewayRef | None = None

    @property
    def mode(self) -> str:
        """The routing mode as `kubectl get modelservers` shows it."""
        if not self.inference_pool:
            return "Service"
        if self.gateway is None:
            return "InferencePool"
        return f"InferencePool+Gateway {self.gateway.namespace}/{self.gateway.name}"


@dataclass(frozen=True)
class ModelServerSpec:
    name: str
    namespace: str
    model: str
    served_model_name: str | None = None
    image: str = DEFAULT_IMAGE
    replicas: int = DEFAULT_REPLICAS
    startup_timeout_s: int = DEFAULT_STARTUP_TIMEOUT_S
    engine: EngineSpec = EngineSpec()
    resources: ResourcesSpec = ResourcesSpec()
    model_cache: CacheSpec | None = None
    hf_token_secret: str | None = None
    autoscaling: AutoscalingSpec | None = None
    ingress: IngressSpec | None = None
    routing: RoutingSpec = RoutingSpec()
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    pod_annotations: dict[str, str] = field(default_factory=dict)
    env: tuple[dict[str, Any], ...] = ()

    @property
    def model_name(self) -> str:
        """The name metrics carry (`model_name` label): the first of the served names."""
        names = [n.strip() for n in (self.served_model_name or "").split(",") if n.strip()]
        return names[0] if names else self.model


def _split(path: str) -> tuple[str, str]:
    """("engine.", "numPages") for "engine.numPages": the prefix for messages, and the key."""
    where, _, key = path.rpartition(".")
    return (where + "." if where else ""), key


def _int(d: Mapping[str, Any], path: str, default: Any = _FROM_SCHEMA) -> Any:
    node = SPEC.at(path)
    _, key = _split(path)
    value = d.get(key, node.default if default is _FROM_SCHEMA else default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{path} must be an integer, got {value!r}")
    if node.minimum is not None and value < node.minimum:
        raise SpecError(f"{path} must be >= {node.minimum}, got {value}")
    if node.maximum is not None and value > node.maximum:
        raise SpecError(f"{path} must be <= {node.maximum}, got {value}")
    return value


def _positive(d: Mapping[str, Any], path: str) -> float | None:
    _, key = _split(path)
    value = d.get(key)
    if value is None:
        return None
    # `not value > 0` (not `value <= 0`): NaN compares false either way and must fail too.
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not value > 0 or not math.isfinite(value):
        raise SpecError(f"{path} must be a finite number > 0, got {value!r}")
    return float(value)


def _bool(d: Mapping[str, Any], path: str) -> bool:
    _, key = _split(path)
    value = d.get(key, SPEC.at(path).default)
    if not isinstance(value, bool):  # "false" is a non-empty string: truthy
        raise SpecError(f"{path} must be true or false, got {value!r}")
    return value


def _str(d: Mapping[str, Any], path: str) -> str | None:
    _, key = _split(path)
    value = d.get(key, SPEC.at(path).default)
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # quantities may be written as plain numbers
    if not isinstance(value, str) or not value:
        raise SpecError(f"{path} must be a non-empty string, got {value!r}")
    return value


def _choice(d: Mapping[str, Any], path: str) -> str | None:
    """A string field the schema gives choices for (its enum), checked against them."""
    value = _str(d, path)
    choices = SPEC.at(path).enum
    if value is not None and value not in choices:
        raise SpecError(f"{path} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _quantity(d: Mapping[str, Any], path: str) -> str | None:
    value = _str(d, path)
    if value is not None and not re.fullmatch(QUANTITY_PATTERN, value):
        raise SpecError(
            f"{path} must be a Kubernetes quantity such as 24Gi, 500m or 4, got {value!r}"
        )
    return value


def _byte_size(d: Mapping[str, Any], path: str) -> str | None:
    """A quantity whose numbers are whole (int-or-string in the CRD, so CEL can compare it)."""
    _, key = _split(path)
    if isinstance(d.get(key), float):
        raise SpecError(f"{path} must be a quantity such as 100Gi or a whole number of bytes")
    return _quantity(d, path)


def _name(d: Mapping[str, Any], path: str) -> str | None:
    """A name field: its schema's pattern (the CRD checks it with CEL)."""
    value = _str(d, path)
    node = SPEC.at(path)
    assert node.name_pattern is not None, path
    longest = node.keywords["maxLength"]
    if value is not None and (len(value) > longest or not re.fullmatch(node.name_pattern, value)):
        raise SpecError(f"{path} {node.rules[0][1]}, got {value!r}")
    return value


def _obj(d: Mapping[str, Any], key: str, where: str) -> Mapping[str, Any] | None:
    value = d.get(key)
    if value is not None and not isinstance(value, Mapping):
        raise SpecError(f"{where}{key} must be an object")
    return value


def _str_map(d: Mapping[str, Any], key: str) -> dict[str, str]:
    value = _obj(d, key, "") or {}
    return {str(k): str(v) for k, v in value.items()}


def _list_of_objects(d: Mapping[str, Any], key: str) -> tuple[dict[str, Any], ...]:
    value = d.get(key) or []
    if not isinstance(value, list) or not all(isinstance(x, Mapping) for x in value):
        raise SpecError(f"{key} must be a list of objects")
    return tuple(dict(x) for x in value)


def _speculative(raw: Mapping[str, Any] | None) -> SpeculativeSpec | None:
    if raw is None:
        return None
    algorithm = _choice(raw, "engine.speculative.algorithm")
    if algorithm is None:
        raise SpecError("engine.speculative.algorithm is required")
    draft = _str(raw, "engine.speculative.draftModelPath")
    if algorithm == "eagle3" and draft is None:
        raise SpecError("engine.speculative.draftModelPath is required with algorithm eagle3")
    if algorithm != "eagle3" and draft is not None:
        raise SpecError("engine.speculative.draftModelPath is for algorithm eagle3 only")
    return SpeculativeSpec(
        algorithm=algorithm,
        num_draft_tokens=_int(raw, "engine.speculative.numDraftTokens"),
        draft_model_path=draft,
    )


def _engine(raw: Mapping[str, Any]) -> EngineSpec:
    extra = raw.get("extraArgs") or []
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        raise SpecError("engine.extraArgs must be a list of strings")
    tp = _int(raw, "engine.tensorParallelSize")
    nodes = _int(raw, "engine.nodes")
    if tp % nodes:
        raise SpecError(
            f"engine.tensorParallelSize ({tp}) must divide by engine.nodes ({nodes}): "
            "every pod runs the same number of ranks"
        )
    return EngineSpec(
        dtype=_choice(raw, "engine.dtype"),
        quantization=_choice(raw, "engine.quantization"),
        lm_head_quantization=_choice(raw, "engine.lmHeadQuantization"),
        kv_cache_dtype=_choice(raw, "engine.kvCacheDtype"),
        tensor_parallel_size=tp,
        nodes=nodes,
        num_pages=_int(raw, "engine.numPages"),
        max_seq_len=_int(raw, "engine.maxSeqLen"),
        max_running_requests=_int(raw, "engine.maxRunningRequests"),
        shutdown_timeout_s=_int(raw, "engine.shutdownTimeoutSeconds"),
        speculative=_speculative(_obj(raw, "speculative", "engine.")),
        extra_args=tuple(extra),
    )


def _autoscaling(raw: Mapping[str, Any]) -> AutoscalingSpec:
    if raw.get("maxReplicas") is None:
        raise SpecError("autoscaling.maxReplicas is required")
    lo = _int(raw, "autoscaling.minReplicas")
    hi = _int(raw, "autoscaling.maxReplicas")
    if lo > hi:
        raise SpecError(f"autoscaling.minReplicas ({lo}) must not exceed maxReplicas ({hi})")
    t = _obj(raw, "targets", "autoscaling.")
    t = DEFAULT_TARGETS if t is None else t
    targets = Targets(
        ttft_p95_s=_positive(t, "autoscaling.targets.ttftP95Seconds"),
        tpot_p95_s=_positive(t, "autoscaling.targets.tpotP95Seconds"),
        waiting_per_replica=_positive(t, "autoscaling.targets.waitingRequestsPerReplica"),
    )
    if targets == Targets():
        raise SpecError("autoscaling.targets needs at least one target")
    url = _str(raw, "autoscaling.prometheusUrl")
    if url is not None and not re.match(r"^https?://", url):
        raise SpecError(f"autoscaling.prometheusUrl must start with http:// or https://: {url!r}")
    return AutoscalingSpec(
        min_replicas=lo,
        max_replicas=hi,
        targets=targets,
        scale_up_stabilization_s=_int(raw, "autoscaling.scaleUpStabilizationSeconds"),
        scale_down_stabilization_s=_int(raw, "autoscaling.scaleDownStabilizationSeconds"),
        prometheus_url=url,
    )


def _routing(raw: Mapping[str, Any], namespace: str) -> RoutingSpec:
    pool = _bool(raw, "routing.inferencePool")
    ref = _obj(raw, "gatewayRef", "routing.")
    gateway = None
    if ref is not None:
        if not pool:
            raise SpecError("routing.gatewayRef needs routing.inferencePool: true")
        name = _name(ref, "routing.gatewayRef.name")
        if name is None:
            raise SpecError("routing.gatewayRef.name is required")
        gateway = GatewayRef(name, _name(ref, "routing.gatewayRef.namespace") or namespace)
    return RoutingSpec(inference_pool=pool, gateway=gateway)


def parse_spec(name: str, namespace: str, spec: Mapping[str, Any] | None) -> ModelServerSpec:
    """Validate a ModelServer's spec; raise `SpecError` with a user-facing message if invalid."""
    if len(name) > MAX_NAME_LEN or not _DNS1035.match(name):
        raise SpecError(
            f"name {name!r} must be a DNS-1035 label (lowercase letters, digits, '-', "
            f"starting with a letter) of at most {MAX_NAME_LEN} characters"
        )
    if not isinstance(spec, Mapping):
        raise SpecError("spec is missing")
    model = _str(spec, "model")
    if model is None:
        raise SpecError("spec.model is required")
    engine = _engine(_obj(spec, "engine", "") or {})
    if engine.multi_node and len(name) > MAX_MULTI_NODE_NAME_LEN:
        raise SpecError(
            f"name {name!r} must be at most {MAX_MULTI_NODE_NAME_LEN} characters with "
            "engine.nodes > 1 (LeaderWorkerSet names its pods after it)"
        )
    res_raw = _obj(spec, "resources", "") or {}
    per_pod = engine.ranks_per_node
    gpus = _int(res_raw, "resources.gpus", per_pod)
    if 0 < gpus < per_pod:
        raise SpecError(
            f"resources.gpus ({gpus}) must be 0 (CPU) or at least "
            f"engine.tensorParallelSize / engine.nodes ({per_pod}), the ranks of one pod"
        )
    resources = ResourcesSpec(
        gpus=gpus,
        cpu=_quantity(res_raw, "resources.cpu"),
        memory=_quantity(res_raw, "resources.memory"),
        shared_memory=_quantity(res_raw, "resources.sharedMemory"),
    )
    cache_raw = _obj(spec, "modelCache", "")
    cache = None
    if cache_raw is not None:
        cache = CacheSpec(
            size=_byte_size(cache_raw, "modelCache.size") or DEFAULT_CACHE_SIZE,
            storage_class_name=(
                _name(cache_raw, "modelCache.storageClassName")
                if cache_raw.get("storageClassName")
                else None
            ),
            existing_claim=_name(cache_raw, "modelCache.existingClaim"),
        )
    auto_raw = _obj(spec, "autoscaling", "")
    ing_raw = _obj(spec, "ingress", "")
    ingress = None
    if ing_raw is not None:
        host = _name(ing_raw, "ingress.host")
        if host is None:
            raise SpecError("ingress.host is required")
        ingress = IngressSpec(
            host=host,
            class_name=_name(ing_raw, "ingress.className"),
            tls=_bool(ing_raw, "ingress.tls"),
            annotations=_str_map(ing_raw, "annotations"),
        )
    for tol in _list_of_objects(spec, "tolerations"):
        if tol.get("operator", "Equal") not in TOLERATION_OPERATORS:
            raise SpecError(
                f"tolerations: operator must be Exists or Equal, got {tol['operator']!r}"
            )
        if tol.get("effect") not in _TOLERATION_EFFECTS:
            raise SpecError(f"tolerations: unknown effect {tol['effect']!r}")
    for item in _list_of_objects(spec, "env"):
        if not item.get("name"):
            raise SpecError("every env entry needs a name")
    return ModelServerSpec(
        name=name,
        namespace=namespace,
        model=model,
        served_model_name=_str(spec, "servedModelName"),
        image=_str(spec, "image") or DEFAULT_IMAGE,
        replicas=_int(spec, "replicas"),
        startup_timeout_s=_int(spec, "startupTimeoutSeconds"),
        engine=engine,
        resources=resources,
        model_cache=cache,
        hf_token_secret=_name(spec, "hfTokenSecret"),
        autoscaling=_autoscaling(auto_raw) if auto_raw is not None else None,
        ingress=ingress,
        routing=_routing(_obj(spec, "routing", "") or {}, namespace),
        node_selector=_str_map(spec, "nodeSelector"),
        tolerations=_list_of_objects(spec, "tolerations"),
        pod_annotations=_str_map(spec, "podAnnotations"),
        env=_list_of_objects(spec, "env"),
    )
