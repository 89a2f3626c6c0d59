"""spec.engine.quantization: a float checkpoint quantized at load, from the ModelServer down to
the pod's `--quantization` flag, its choices the engine's own (minisgl.config.QUANTIZATIONS);
spec.engine.lmHeadQuantization likewise to `--lm-head-quantization`."""

from __future__ import annotations

import pytest
from k8s_support import crd_schema
from minisgl_operator.children import Cluster, plan
from minisgl_operator.spec import SpecError, parse_spec
from test_k8s_children import container, flags, make, owner

from minisgl.config import LM_HEAD_QUANTIZATIONS, QUANTIZATIONS, ServerArgs


@pytest.mark.parametrize("method", QUANTIZATIONS)
def test_quantization_becomes_the_flag(method: str) -> None:
    p = make({"model": "Qwen/Qwen3-8B", "engine": {"quantization": method}})
    assert flags(p).quantization == method
    assert "--quantization" in container(p)["command"]


def test_left_out_it_stays_minisgls_default() -> None:
    p = make({"model": "Qwen/Qwen3-8B-AWQ"})  # a quantized checkpoint needs no flag
    assert "--quantization" not in container(p)["command"]
    assert flags(p).quantization is ServerArgs.quantization is None


def test_crd_offers_the_engines_choices() -> None:
    engine = crd_schema()["properties"]["spec"]["properties"]["engine"]["properties"]
    assert tuple(engine["quantization"]["enum"]) == QUANTIZATIONS
    assert "default" not in engine["quantization"]
    assert "--quantization" in engine["quantization"]["description"]


def test_unknown_method_and_extra_args_are_refused() -> None:
    with pytest.raises(SpecError, match="engine.quantization must be one of int8, int4, fp8"):
        parse_spec("m", "ns", {"model": "m", "engine": {"quantization": "nf4"}})
    with pytest.raises(SpecError, match="may not set --quantization"):
        plan(owner({"model": "m", "engine": {"extraArgs": ["--quantization", "int8"]}}), Cluster())


@pytest.mark.parametrize("method", [m for m in LM_HEAD_QUANTIZATIONS if m != "auto"])
def test_lm_head_quantization_becomes_the_flag(method: str) -> None:
    p = make({"model": "Qwen/Qwen3-8B", "engine": {"quantization": "int4",
                                                    "lmHeadQuantization": method}})  # fmt: skip
    assert flags(p).lm_head_quantization == method
    command = container(p)["command"]
    assert command[command.index("--lm-head-quantization") + 1] == method


def test_lm_head_quantization_left_out_stays_auto() -> None:
    p = make({"model": "Qwen/Qwen3-8B", "engine": {"quantization": "int8"}})
    assert "--lm-head-quantization" not in container(p)["command"]
    assert flags(p).lm_head_quantization == ServerArgs.lm_head_quantization == "auto"
    engine = crd_schema()["properties"]["spec"]["properties"]["engine"]["properties"]
    assert tuple(engine["lmHeadQuantization"]["enum"]) == LM_HEAD_QUANTIZATIONS
    assert "default" not in engine["lmHeadQuantization"]


def test_unknown_lm_head_quantization_and_extra_args_are_refused() -> None:
    with pytest.raises(SpecError, match="engine.lmHeadQuantization must be one of auto, none"):
        parse_spec("m", "ns", {"model": "m", "engine": {"lmHeadQuantization": "q6_k"}})
    with pytest.raises(SpecError, match="may not set --lm-head-quantization"):
        extra = ["--lm-head-quantization", "none"]
        plan(owner({"model": "m", "engine": {"extraArgs": extra}}), Cluster())


@pytest.mark.parametrize("flag", ["--cpu-quantized-activations", "--cpu-int4-activations"])
def test_quantized_activations_reach_the_pod_through_extra_args(flag: str) -> None:
    """--cpu-quantized-activations (and its old name) has no spec field: engine.extraArgs
    carries it to the pod, where it sets the one config field; a value the engine does not
    take is refused when the ModelServer is planned, not by a crashing pod."""
    spec = {"model": "Qwen/Qwen3-8B", "engine": {"quantization": "int8",
                                                 "extraArgs": [flag, "int8"]}}  # fmt: skip
    assert flags(make(spec)).cpu_quantized_activations == "int8"
    with pytest.raises(SpecError, match="engine flags rejected"):
        bad = {"model": "m", "engine": {"extraArgs": [flag, "int4"]}}
        plan(owner(bad), Cluster())
