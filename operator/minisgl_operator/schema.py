"""The ModelServer's fields, once: type, bounds, default and description of every spec and
status field.

Two things are generated from this one declaration, so they cannot drift apart: the CRD's
OpenAPI schema (`python -m minisgl_operator.crd --write` renders the chart's CRD file, which is
what `kubectl explain modelserver.spec` prints) and the operator's parsing (`spec.parse_spec`
takes its defaults, bounds and enums from here). Engine fields describe themselves with the
help text of the `python -m minisgl` flag they become (from `minisgl.config`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from minisgl.config import (
    DTYPES,
    KV_CACHE_DTYPES,
    LM_HEAD_QUANTIZATIONS,
    QUANTIZATIONS,
    SPECULATIVE_ALGORITHMS,
    ServerArgs,
    flag_name,
)

MAX_NAME_LEN = 57  # the longest child name adds "-cache"; names must stay <= 63
# A LeaderWorkerSet's StatefulSets are <name>-<group>, and each labels its pods with
# <statefulset>-<revision hash> (at most 63 characters): room for 3-digit groups and the hash.
MAX_MULTI_NODE_NAME_LEN = 45


@dataclass(frozen=True)
class Node:
    """One field of the schema (an object's properties and an array's items are Nodes too)."""

    description: str
    keywords: Mapping[str, Any] = field(default_factory=dict)  # type, minimum, default, ...
    properties: Mapping[str, Node] = field(default_factory=dict)
    items: Node | None = None
    required: tuple[str, ...] = ()
    rules: tuple[tuple[str, str], ...] = ()  # CEL (rule, message): x-kubernetes-validations
    name_pattern: str | None = None  # what a name field's CEL rule matches (for the operator)

    @property
    def default(self) -> Any:
        return self.keywords.get("default")

    @property
    def minimum(self) -> Any:
        return self.keywords.get("minimum")

    @property
    def maximum(self) -> Any:
        return self.keywords.get("maximum")

    @property
    def enum(self) -> tuple[Any, ...]:
        return tuple(self.keywords.get("enum") or ())

    def at(self, path: str) -> Node:
        """The field at a dotted path below this one ("autoscaling.targets.ttftP95Seconds");
        "[]" steps into an array's items ("tolerations[].effect")."""
        node = self
        for part in path.split("."):
            node = node.properties[part.removesuffix("[]")]
            if part.endswith("[]"):
                assert node.items is not None, path
                node = node.items
        return node

    @property
    def full_default(self) -> Any:
        """The default as the CRD declares it: an object's default carries its fields' own
        defaults. The API server checks a default, CEL rules included, as written (it does not
        default inside it), so `engine: {}` would fail `tensorParallelSize % nodes == 0`."""
        if not isinstance(self.default, dict):
            return self.default
        inner = {k: v.full_default for k, v in self.properties.items() if v.default is not None}
        return {**inner, **self.default}

    def openapi(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if "type" in self.keywords:
            out["type"] = self.keywords["type"]
        if self.description:  # metadata's schema may hold nothing but its type
            out["description"] = self.description
        if self.default not in (None, {}):  # the default is stated once: here
            out["description"] += f" Default: {json.dumps(self.default)}."
        out.update({k: v for k, v in self.keywords.items() if k != "type"})
        if self.default is not None:
            out["default"] = self.full_default
        if self.required:
            out["required"] = list(self.required)
        if self.rules:
            out["x-kubernetes-validations"] = [{"rule": r, "message": m} for r, m in self.rules]
        if self.properties:
            out["properties"] = {k: v.openapi() for k, v in self.properties.items()}
        if self.items is not None:
            out["items"] = self.items.openapi()
        return out


# -- constructors: one per kind of field ----------------------------------------------------


def integer(description: str, fmt: str = "int32", **kw: Any) -> Node:
    return Node(description, {"type": "integer", "format": fmt, **kw})


def number(description: str, **kw: Any) -> Node:
    return Node(description, {"type": "number", **kw})


def positive(description: str) -> Node:
    return number(description, exclusiveMinimum=True, minimum=0)


def string(description: str, **kw: Any) -> Node:
    return Node(description, {"type": "string", **kw})


def boolean(description: str, **kw: Any) -> Node:
    return Node(description, {"type": "boolean", **kw})


# A non-negative Kubernetes quantity (resource.Quantity's grammar): the API server checks a
# ModelServer's against it, so that "lots" or "-1" is refused there, not later by the
# Deployment or claim it would become (with a message about a child the user never wrote).
_DECIMAL = r"(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
QUANTITY_PATTERN = rf"^\+?{_DECIMAL}(([KMGTPE]i)|[numkMGTPE]|([eE][-+]?{_DECIMAL}))?$"


def quantity(description: str, **kw: Any) -> Node:
    """A Kubernetes quantity: "8Gi", "500m" or a plain number such as 4 or 0.5 (never negative),
    as a Pod's resources take it.

    x-kubernetes-int-or-string would refuse 0.5 (its type is integer or string), and CEL cannot
    see a node without a type, so this one has none (preserve-unknown-fields) and checks by
    value: a string by the pattern, a number by its minimum (each keyword applies to its own
    JSON type only), and the rest (true, {}, [1], ...) is refused."""
    return Node(
        description,
        {
            "x-kubernetes-preserve-unknown-fields": True,
            "pattern": QUANTITY_PATTERN,
            "maxLength": 64,
            "minimum": 0,
            "maxProperties": 0,
            "maxItems": 0,
            "not": {"enum": [True, False, {}, []]},
            **kw,
        },
    )


def byte_size(description: str, **kw: Any) -> Node:
    """A size in bytes: a quantity string ("100Gi") or a whole number. Unlike `quantity`, the
    node has a type (int-or-string), so CEL sees it: a claim's size may grow but never shrink,
    and the rule that says so compares sizes with quantity()."""
    return Node(
        description,
        {
            "x-kubernetes-int-or-string": True,
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "maxLength": 64,  # bounds the CEL rules' cost
            **kw,
        },
        rules=(
            (
                f"type(self) == int ? self >= 0 : self.matches(r'{QUANTITY_PATTERN}')",
                "must be a Kubernetes quantity (not negative) such as 100Gi or 500G, or a "
                "whole number of bytes",
            ),
        ),
    )


# Names the children refer to (a Secret, a claim, a class, a Gateway, a host): refused at
# admission when the API server would refuse the child that carries them.
_LABEL = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS_SUBDOMAIN_PATTERN = rf"^{_LABEL}(\.{_LABEL})*$"
DNS_LABEL_PATTERN = rf"^{_LABEL}$"
HOST_PATTERN = rf"^(\*\.)?{_LABEL}(\.{_LABEL})*$"
_NAME_KINDS = {  # pattern: (longest, what a value must be)
    DNS_SUBDOMAIN_PATTERN: (
        253,
        "a Kubernetes object name: lowercase letters, digits, '-' and '.', starting and ending "
        "with a letter or digit",
    ),
    DNS_LABEL_PATTERN: (
        63,
        "a namespace name: lowercase letters, digits and '-', starting and ending with a letter "
        "or digit",
    ),
    HOST_PATTERN: (253, "a lowercase DNS name such as qwen.example.com (or *.example.com)"),
}


def object_name(
    description: str, pattern: str = DNS_SUBDOMAIN_PATTERN, allow_empty: bool = False
) -> Node:
    """A string that names something in the cluster; `pattern` is one of the three above.
    `allow_empty`: "" stays accepted (and means the field is not set)."""
    longest, what = _NAME_KINDS[pattern]
    message = f"must be {what}"
    rule = f"self.matches(r'{pattern}')"
    return Node(
        description,
        {"type": "string", **({} if allow_empty else {"minLength": 1}), "maxLength": longest},
        rules=((f"self == '' || {rule}" if allow_empty else rule, message),),
        name_pattern=pattern,
    )


def obj(description: str, properties: Mapping[str, Node], **kw: Any) -> Node:
    required = tuple(kw.pop("required", ()))
    rules = tuple(kw.pop("rules", ()))
    return Node(description, {"type": "object", **kw}, properties, None, required, rules)


def string_map(description: str) -> Node:
    return Node(description, {"type": "object", "additionalProperties": {"type": "string"}})


def array(description: str, items: Node, **kw: Any) -> Node:
    return Node(description, {"type": "array", **kw}, items=items)


def engine_flag(server_field: str, node: Node, note: str = "") -> Node:
    """A spec field that becomes a `python -m minisgl` flag: described by that flag's help."""
    f = next(f for f in dataclasses.fields(ServerArgs) if f.name == server_field)
    text = f.metadata["help"]
    text = text[0].upper() + text[1:]
    # The CRD's own default, when it has one, is stated by openapi(); else minisgl's applies.
    default = "" if f.default is None or node.default is not None else f" Default: {f.default}."
    note = f" {note}" if note else ""
    desc = f"{text}.{note} Becomes `{flag_name(server_field)}`.{default}"
    return dataclasses.replace(node, description=desc)


# -- the spec --------------------------------------------------------------------------------

TOLERATION_OPERATORS = ("Exists", "Equal")
TOLERATION_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")

SPECULATIVE = obj(
    "Speculative decoding (docs/serving.md): draft tokens proposed cheaply and verified in one "
    "forward of the model, so one stream may gain several tokens per step; the output is the "
    "same as without it. Left out: off.",
    {
        "algorithm": engine_flag(
            "speculative_algorithm", string("", enum=list(SPECULATIVE_ALGORITHMS))
        ),
        "numDraftTokens": engine_flag("speculative_num_draft_tokens", integer("", minimum=1)),
        "draftModelPath": engine_flag(
            "speculative_draft_model_path",
            string("", minLength=1),
            "With algorithm eagle3 only (and then required); a path may be on the model cache "
            "volume.",
        ),
    },
    required=["algorithm"],
    rules=[
        (
            "self.algorithm != 'eagle3' || has(self.draftModelPath)",
            "engine.speculative.draftModelPath is required with algorithm eagle3",
        ),
        (
            "self.algorithm == 'eagle3' || !has(self.draftModelPath)",
            "engine.speculative.draftModelPath is for algorithm eagle3 only",
        ),
    ],
)

ENGINE = obj(
    "How the server runs the model: each field becomes a `python -m minisgl` flag; fields "
    "left out keep minisgl's own defaults.",
    {
        "dtype": engine_flag("dtype", string("", enum=list(DTYPES))),
        "quantization": engine_flag(
            "quantization",
            string("", enum=list(QUANTIZATIONS)),
            "For a float checkpoint; see docs/models.md for the formats.",
        ),
        "lmHeadQuantization": engine_flag(
            "lm_head_quantization",
            string("", enum=list(LM_HEAD_QUANTIZATIONS)),
            "See docs/models.md.",
        ),
        "kvCacheDtype": engine_flag(
            "kv_cache_dtype",
            string("", enum=list(KV_CACHE_DTYPES)),
            "See docs/serving.md.",
        ),
        "tensorParallelSize": engine_flag(
            "tp_size",
            integer("", minimum=1, default=ServerArgs.tp_size),
            "GPUs one model spans (over all engine.nodes pods); resources.gpus defaults to "
            "it divided by engine.nodes.",
        ),
        "nodes": integer(
            "Pods (nodes) one model spans: with more than 1, a LeaderWorkerSet runs each "
            "replica as a group of this many pods (the leader serves the API), the "
            "tensorParallelSize ranks split evenly over them, and the pods get "
            "`--nnodes`, `--node-rank` and `--dist-init-addr`. Needs LeaderWorkerSet "
            "(kubernetes-sigs/lws) in the cluster. tensorParallelSize must divide by it.",
            minimum=1,
            maximum=64,
            default=1,
        ),
        "numPages": engine_flag("num_pages", integer("", minimum=1)),
        "maxSeqLen": engine_flag("max_seq_len_override", integer("", minimum=1), "In tokens."),
        "maxRunningRequests": engine_flag("max_running_requests", integer("", minimum=1)),
        "shutdownTimeoutSeconds": engine_flag(
            "shutdown_timeout",
            integer("", minimum=1, maximum=3600),
            "The pod's termination grace period is set to cover it.",
        ),
        "speculative": SPECULATIVE,
        "extraArgs": array(
            "More `python -m minisgl` flags, appended to the command line, e.g. "
            '["--max-prefill-tokens", "8192"]. Full flag names only (no abbreviations); flags '
            "that have a field here (model, served name, host, port, device, dtype, quantization, "
            "LM head quantization, KV cache dtype, TP "
            "size, pages, context, running requests, shutdown timeout, speculative algorithm, "
            "draft tokens and draft model) must be set through it. A "
            "flag the server rejects makes the ModelServer Degraded (InvalidSpec).",
            string("One command-line word: a flag or its value."),
            maxItems=64,
        ),
    },
    default={},
    rules=[
        (
            "self.tensorParallelSize % self.nodes == 0",
            "engine.tensorParallelSize must divide by engine.nodes",
        )
    ],
)

RESOURCES = obj(
    "What each pod asks the scheduler for.",
    {
        "gpus": integer(
            "nvidia.com/gpu per pod (a limit); 0 runs on CPU (`--device cpu`), more runs on "
            "CUDA. Default: engine.tensorParallelSize / engine.nodes (the ranks of one pod). "
            "Must be 0 or at least that.",
            minimum=0,
        ),
        "cpu": quantity("CPU request of the server container, e.g. 4 or 500m. Default: none."),
        "memory": quantity(
            "Memory request and limit of the server container, e.g. 32Gi. Default: none."
        ),
        "sharedMemory": quantity(
            "Size limit of the memory-backed /dev/shm volume (used by the tensor-parallel "
            "ranks). Default: no limit beyond the pod's memory."
        ),
    },
)

MODEL_CACHE = obj(
    "A persistent volume for downloaded weights, mounted at /cache (HF_HOME=/cache/huggingface)"
    ", so a restarted pod does not download the model again. Without it, weights go to an "
    "emptyDir that lives as long as the pod.",
    {
        "size": byte_size(
            "Size of the PersistentVolumeClaim <name>-cache. It may grow (if its StorageClass "
            "allows volume expansion) but not shrink: a claim cannot.",
            default="100Gi",
        ),
        "storageClassName": object_name(
            "StorageClass of that claim. Default: the cluster's default class.",
            allow_empty=True,
        ),
        "existingClaim": object_name(
            "Use this existing PersistentVolumeClaim instead of creating <name>-cache."
        ),
    },
    # A claim's class is immutable and its size cannot shrink: such an edit would leave the
    # ModelServer Degraded for good (the claim refused). Refused here instead, while the
    # operator's own claim is in use (before and after the edit).
    rules=[
        (
            "has(self.existingClaim) || has(oldSelf.existingClaim) || "
            "(has(self.storageClassName) ? self.storageClassName : '') == "
            "(has(oldSelf.storageClassName) ? oldSelf.storageClassName : '')",
            "modelCache.storageClassName cannot change: the claim <name>-cache keeps the class "
            "it was made with. Remove modelCache (the operator deletes its claim) and add it "
            "back with the new class, or use existingClaim",
        ),
        (
            "has(self.existingClaim) || has(oldSelf.existingClaim) || "
            "!isQuantity(string(self.size)) || !isQuantity(string(oldSelf.size)) || "
            "quantity(string(self.size)).compareTo(quantity(string(oldSelf.size))) >= 0",
            "modelCache.size cannot shrink: a PersistentVolumeClaim only grows. Remove "
            "modelCache (the operator deletes its claim) and add it back with the smaller "
            "size, or use existingClaim",
        ),
    ],
)

TARGETS = obj(
    "SLO targets the autoscaler keeps (from the pods' Prometheus metrics): it adds pods when "
    "any target is exceeded. At least one must be set.",
    {
        "ttftP95Seconds": positive(
            "95th percentile time to first token, in seconds, over the last minutes "
            "(minisgl_time_to_first_token_seconds)."
        ),
        "tpotP95Seconds": positive(
            "95th percentile time per output token, in seconds "
            "(minisgl_time_per_output_token_seconds)."
        ),
        "waitingRequestsPerReplica": positive(
            "Requests waiting for a batch slot, per pod (minisgl_num_requests_waiting)."
        ),
    },
    default={"waitingRequestsPerReplica": 8},
    rules=[
        (
            "has(self.ttftP95Seconds) || has(self.tpotP95Seconds) || "
            "has(self.waitingRequestsPerReplica)",
            "autoscaling.targets needs at least one target",
        )
    ],
)

AUTOSCALING = obj(
    "Scale the pods between minReplicas and maxReplicas on SLO targets: a KEDA ScaledObject "
    "when KEDA is installed, else an autoscaling/v2 HorizontalPodAutoscaler on "
    "prometheus-adapter metrics. The autoscaler writes spec.replicas through /scale.",
    {
        "minReplicas": integer("Fewest pods.", minimum=1, default=1),
        "maxReplicas": integer("Most pods.", minimum=1),
        "targets": TARGETS,
        "scaleUpStabilizationSeconds": integer(
            "Seconds the autoscaler looks back before adding pods "
            "(behavior.scaleUp.stabilizationWindowSeconds).",
            minimum=0,
            maximum=3600,
            default=60,
        ),
        "scaleDownStabilizationSeconds": integer(
            "Seconds of lower load before a pod is removed "
            "(behavior.scaleDown.stabilizationWindowSeconds); long, since a new pod may take "
            "minutes to load the model.",
            minimum=0,
            maximum=3600,
            default=600,
        ),
        "prometheusUrl": string(
            "Prometheus that KEDA queries, e.g. http://prometheus.monitoring:9090. Default: "
            "the operator's --prometheus-url.",
            pattern="^https?://",
        ),
    },
    required=["maxReplicas"],
    rules=[
        (
            "self.minReplicas <= self.maxReplicas",
            "autoscaling.minReplicas must not exceed autoscaling.maxReplicas",
        )
    ],
)

INGRESS = obj(
    "An Ingress <name> routing http(s)://host/ to the Service; status.endpoint then names it.",
    {
        "host": object_name("Host name clients use, e.g. qwen.example.com.", HOST_PATTERN),
        "className": object_name(
            "IngressClass (ingressClassName). Default: the cluster's default."
        ),
        "tls": boolean(
            "Serve TLS from the Secret <name>-tls (e.g. made by cert-manager).", default=False
        ),
        "annotations": string_map("Annotations of the Ingress (e.g. for cert-manager)."),
    },
    required=["host"],
)

GATEWAY_REF = obj(
    "A Gateway (gateway.networking.k8s.io/v1) to route from: the operator adds an HTTPRoute "
    "<name> sending every path on it to the InferencePool. The Gateway must allow routes "
    "from this namespace (its listeners' allowedRoutes).",
    {
        "name": object_name("Name of the Gateway."),
        "namespace": object_name(
            "Namespace of the Gateway. Default: the ModelServer's.", DNS_LABEL_PATTERN
        ),
    },
    required=["name"],
)

ROUTING = obj(
    "Load- and cache-aware routing through the Gateway API Inference Extension: instead of "
    "the Service's round robin, an endpoint picker chooses a pod per request from each pod's "
    "queue length and KV-cache use.",
    {
        "inferencePool": boolean(
            "Create an InferencePool <name> (inference.networking.k8s.io/v1) over the serving "
            "pods (the leaders with engine.nodes > 1) and its endpoint picker <name>-epp "
            "(Deployment, Service, ServiceAccount, Role). Needs the InferencePool CRD in the "
            "cluster.",
            default=False,
        ),
        "gatewayRef": GATEWAY_REF,
    },
    rules=[
        (
            "!has(self.gatewayRef) || self.inferencePool",
            "routing.gatewayRef needs routing.inferencePool: true",
        )
    ],
)

TOLERATION = obj(
    "A pod toleration, as in a Pod's spec.tolerations.",
    {
        "key": string("Taint key to tolerate; empty with operator Exists: every taint."),
        "operator": string(
            "Exists (any value) or Equal (the value below). Default: Equal.",
            enum=list(TOLERATION_OPERATORS),
        ),
        "value": string("Taint value to match with operator Equal."),
        "effect": string(
            "Taint effect to tolerate; empty: every effect.", enum=list(TOLERATION_EFFECTS)
        ),
        "tolerationSeconds": integer(
            "With NoExecute: seconds the pod stays bound after the taint appears.", fmt="int64"
        ),
    },
)

ENV_VAR = obj(
    "An environment variable of the server container, as in a container's env. An entry "
    "named like one the operator sets (HF_HOME, HOME, HF_TOKEN) replaces it.",
    {
        "name": string("Variable name.", minLength=1),
        "value": string("Its value."),
        "valueFrom": Node(
            "Its value from a Secret, ConfigMap or field (a Kubernetes EnvVarSource).",
            {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        ),
    },
    required=["name"],
)

SPEC = obj(
    "The model to serve and how: the operator turns it into a Deployment (a LeaderWorkerSet "
    "with engine.nodes > 1) running `python -m minisgl`, a Service <name> on port 8000, and "
    "optionally an autoscaler, an Ingress, a PersistentVolumeClaim for weights and an "
    "InferencePool with its endpoint picker and HTTPRoute.",
    {
        "model": string(
            "Hugging Face hub id (e.g. Qwen/Qwen3-0.6B), a GGUF file on the hub "
            "(<owner>/<repo>:<type>, e.g. Qwen/Qwen3-8B-GGUF:Q8_0) or a path on the model cache "
            "volume (a checkpoint directory or a .gguf file). Becomes `--model`.",
            minLength=1,
        ),
        "servedModelName": string(
            "Model name in the OpenAI API and in metrics (label model_name). Becomes "
            "`--served-model-name`. Default: the model.",
            minLength=1,
        ),
        "image": string(
            "Server image (the container runs `python -m minisgl`).",
            minLength=1,
            default="ghcr.io/minisgl/minisgl-server:0.1.0",
        ),
        "replicas": integer(
            "Replicas of the model: pods of the Deployment, or groups of engine.nodes pods of "
            "the LeaderWorkerSet; written by the autoscaler when autoscaling is "
            "set, and then kept between its bounds.",
            minimum=0,
            default=1,
        ),
        "startupTimeoutSeconds": integer(
            "How long a pod may take to download and load the model before it is restarted "
            "(the startup probe's budget), at most a day: the Deployment's progress deadline "
            "adds 600 s to it and must fit in 32 bits.",
            minimum=60,
            maximum=86400,
            default=1800,
        ),
        "engine": ENGINE,
        "resources": RESOURCES,
        "modelCache": MODEL_CACHE,
        "hfTokenSecret": object_name(
            "Secret holding the Hugging Face token under the key `token`; becomes the HF_TOKEN "
            "environment variable (gated or private models)."
        ),
        "autoscaling": AUTOSCALING,
        "ingress": INGRESS,
        "routing": ROUTING,
        "nodeSelector": string_map("Node labels the pods must run on (the pod's nodeSelector)."),
        "tolerations": array("Taints the pods tolerate (the pod's tolerations).", TOLERATION),
        "podAnnotations": string_map(
            "Annotations added to the pods (next to the Prometheus scrape annotations)."
        ),
        "env": array("More environment variables of the server container.", ENV_VAR),
    },
    required=["model"],
    rules=[
        (
            "!has(self.resources) || !has(self.resources.gpus) || self.resources.gpus == 0 || "
            "self.resources.gpus * self.engine.nodes >= self.engine.tensorParallelSize",
            "resources.gpus must be 0 (CPU) or at least engine.tensorParallelSize / engine.nodes",
        )
    ],
)

# -- the status (written by the operator: status.compute_status) -----------------------------

CONDITION = obj(
    "One condition: Ready (some pod serves), Progressing (a rollout or scale change is under "
    "way) or Degraded (something needs attention; reason and message say what).",
    {
        "type": string("Ready, Progressing or Degraded."),
        "status": string("True, False or Unknown.", enum=["True", "False", "Unknown"]),
        "reason": string(
            "Why, in one CamelCase word (e.g. Serving, Loading, InvalidSpec, NameConflict)."
        ),
        "message": string("Why, for people."),
        "lastTransitionTime": string("When status last changed.", format="date-time"),
        "observedGeneration": integer(
            "metadata.generation this condition was computed for.", fmt="int64"
        ),
    },
    required=["type", "status"],
)

STATUS = obj(
    "What the operator observed, written after every reconcile.",
    {
        "observedGeneration": integer(
            "metadata.generation of the spec the operator last acted on.", fmt="int64"
        ),
        "replicas": integer(
            "Replicas of the workload (any state): pods of the Deployment, or groups of the "
            "LeaderWorkerSet.",
            fmt="int32",
        ),
        "readyReplicas": integer(
            "Replicas whose pods all pass /health (model loaded).", fmt="int32"
        ),
        "routing": string(
            "How requests reach the pods: Service (round robin), InferencePool (the endpoint "
            "picker) or InferencePool+Gateway <namespace>/<name> (a printer column)."
        ),
        "replicaSummary": string("readyReplicas/wanted, e.g. 2/3 (a printer column)."),
        "selector": string(
            "Label selector of the serving pods, leaders only with engine.nodes > 1 (for the "
            "/scale subresource and the autoscalers' per-pod metrics)."
        ),
        "endpoint": string(
            "Where clients reach the OpenAI API: http://<ingress host> with an Ingress (https "
            "with ingress.tls), else http://<name>.<namespace>.svc:8000. Absent while nothing "
            "of ours serves."
        ),
        "observed": obj(
            "The SLOs as Prometheus last reported them (needs the operator's --prometheus-url).",
            {
                "ttftP95Seconds": number("95th percentile time to first token, seconds."),
                "tpotP95Seconds": number("95th percentile time per output token, seconds."),
                "waitingRequests": number("Requests waiting for a batch slot, all pods."),
                "time": string("When these were read (RFC 3339)."),
            },
        ),
        "conditions": Node(
            "Ready, Progressing and Degraded.",
            {
                "type": "array",
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["type"],
            },
            items=CONDITION,
        ),
    },
)
