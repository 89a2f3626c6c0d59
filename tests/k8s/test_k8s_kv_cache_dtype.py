"""spec.engine.kvCacheDtype: the KV cache's dtype from the ModelServer down to the pod's
`--kv-cache-dtype` flag, its choices the engine's own (minisgl.config.KV_CACHE_DTYPES), as the
operator and a real API server both enforce them."""

from __future__ import annotations

from typing import Any

import pytest
from k8s_cluster import Api, install_modelserver_crd
from k8s_support import crd_schema
from minisgl_operator import API_VERSION, KIND
from minisgl_operator.children import Cluster, plan
from minisgl_operator.spec import SpecError, parse_spec
from test_k8s_children import container, flags, make, owner

from minisgl.config import KV_CACHE_DTYPES, ServerArgs


@pytest.mark.parametrize("dtype", [d for d in KV_CACHE_DTYPES if d != "auto"])
def test_kv_cache_dtype_becomes_the_flag(dtype: str) -> None:
    p = make({"model": "Qwen/Qwen3-8B", "engine": {"kvCacheDtype": dtype}})
    assert flags(p).kv_cache_dtype == dtype
    command = container(p)["command"]
    assert command[command.index("--kv-cache-dtype") + 1] == dtype


@pytest.mark.parametrize("engine", [{}, {"kvCacheDtype": "auto"}], ids=["left out", "auto"])
def test_auto_or_left_out_the_cache_keeps_the_models_dtype(engine: dict[str, str]) -> None:
    p = make({"model": "Qwen/Qwen3-8B", "engine": engine})
    assert "--kv-cache-dtype" not in container(p)["command"]  # minisgl's own default
    assert flags(p).kv_cache_dtype == ServerArgs.kv_cache_dtype == "auto"


def test_crd_offers_the_engines_choices_and_names_the_flag() -> None:
    engine = crd_schema()["properties"]["spec"]["properties"]["engine"]["properties"]
    assert tuple(engine["kvCacheDtype"]["enum"]) == KV_CACHE_DTYPES
    assert "default" not in engine["kvCacheDtype"]  # minisgl's own applies
    assert "`--kv-cache-dtype`" in engine["kvCacheDtype"]["description"]
    assert "KV cache dtype" in engine["extraArgs"]["description"]


def test_unknown_dtype_and_the_flag_in_extra_args_are_refused() -> None:
    with pytest.raises(SpecError, match="engine.kvCacheDtype must be one of auto, fp8, fp8_e4m3"):
        parse_spec("m", "ns", {"model": "m", "engine": {"kvCacheDtype": "int8"}})
    for extra in (["--kv-cache-dtype", "fp8"], ["--kv-cache-dtype=fp8"]):
        with pytest.raises(SpecError, match="may not set --kv-cache-dtype"):
            plan(owner({"model": "m", "engine": {"extraArgs": extra}}), Cluster())


def _ms(engine: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": "kv", "namespace": "default"},
        "spec": {"model": "Qwen/Qwen3-8B", "engine": engine},
    }


@pytest.mark.k8s
def test_the_api_server_takes_the_engines_choices_and_refuses_others(cluster: Api) -> None:
    install_modelserver_crd(cluster)
    resp = cluster.create(_ms({"kvCacheDtype": "fp8"}), dry_run=True)
    assert resp.status_code == 201, resp.text
    stored = resp.json()["spec"]
    assert stored["engine"]["kvCacheDtype"] == "fp8"
    assert parse_spec("kv", "default", stored).engine.kv_cache_dtype == "fp8"
    resp = cluster.create(_ms({"kvCacheDtype": "fp16"}), dry_run=True)
    assert resp.status_code == 422, resp.text
    assert "spec.engine.kvCacheDtype" in resp.json()["message"], resp.text
