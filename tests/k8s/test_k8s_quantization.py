"""spec.engine.quantization: a float checkpoint quantized at load, from the ModelServer down to
the pod's `--quantization` flag, its choices the engine's own (minisgl.config.QUANTIZATIONS)."""

from __future__ import annotations

import pytest
from k8s_support import crd_schema
from minisgl_operator.children import Cluster, plan
from minisgl_operator.spec import SpecError, parse_spec
from test_k8s_children import container, flags, make, owner

from minisgl.config import QUANTIZATIONS, ServerArgs


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
