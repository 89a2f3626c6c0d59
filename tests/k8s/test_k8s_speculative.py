"""spec.engine.speculative: speculative decoding from the ModelServer down to the pod's
`--speculative-*` flags, its algorithms the engine's own (minisgl.config.SPECULATIVE_ALGORITHMS);
eagle3 needs its draft head, which nothing else takes, as the real API server also enforces."""

from __future__ import annotations

from typing import Any

import pytest
from k8s_cluster import Api, install_modelserver_crd
from k8s_support import crd_schema
from minisgl_operator import API_VERSION, KIND, spec
from minisgl_operator.children import Cluster, plan
from minisgl_operator.spec import SpecError, parse_spec
from test_k8s_children import container, flags, make, owner

from minisgl.config import SPECULATIVE_ALGORITHMS, ServerArgs

HEAD = "AngelSlim/Qwen3-8B_eagle3"


def test_ngram_becomes_the_flags() -> None:
    p = make({"model": "Qwen/Qwen3-8B", "engine": {"speculative": {"algorithm": "ngram"}}})
    args = flags(p)
    assert args.speculative_algorithm == "ngram"
    assert args.speculative_num_draft_tokens == ServerArgs.speculative_num_draft_tokens
    assert args.speculative_draft_model_path is None
    cmd = container(p)["command"]
    assert "--speculative-num-draft-tokens" not in cmd  # minisgl's own default applies


def test_eagle3_with_its_head_and_draft_tokens_becomes_the_flags() -> None:
    speculative = {"algorithm": "eagle3", "numDraftTokens": 6, "draftModelPath": HEAD}
    args = flags(make({"model": "Qwen/Qwen3-8B", "engine": {"speculative": speculative}}))
    assert args.speculative_algorithm == "eagle3"
    assert args.speculative_num_draft_tokens == 6
    assert args.speculative_draft_model_path == HEAD


def test_left_out_speculation_is_off() -> None:
    p = make({"model": "Qwen/Qwen3-8B"})
    assert not any(w.startswith("--speculative") for w in container(p)["command"])
    assert flags(p).speculative_algorithm is None


def test_crd_offers_the_engines_algorithms_and_names_the_flags() -> None:
    engine = crd_schema()["properties"]["spec"]["properties"]["engine"]["properties"]
    node = engine["speculative"]
    assert node["required"] == ["algorithm"]
    fields = node["properties"]
    assert tuple(fields["algorithm"]["enum"]) == SPECULATIVE_ALGORITHMS
    assert "`--speculative-num-draft-tokens`" in fields["numDraftTokens"]["description"]
    assert "Default: 4." in fields["numDraftTokens"]["description"]  # minisgl's own
    assert "default" not in fields["numDraftTokens"]
    assert "`--speculative-draft-model-path`" in fields["draftModelPath"]["description"]


REFUSED = {
    "no algorithm": ({"numDraftTokens": 4}, "algorithm is required"),
    "unknown algorithm": ({"algorithm": "medusa"}, "must be one of ngram, eagle3"),
    "eagle3 without a head": ({"algorithm": "eagle3"}, "draftModelPath is required"),
    "ngram with a head": ({"algorithm": "ngram", "draftModelPath": HEAD}, "for algorithm eagle3"),
    "no draft tokens": ({"algorithm": "ngram", "numDraftTokens": 0}, "must be >= 1"),
}


@pytest.mark.parametrize("bad,message", REFUSED.values(), ids=REFUSED.keys())
def test_the_operator_refuses_what_cannot_run(bad: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse_spec("m", "ns", {"model": "m", "engine": {"speculative": bad}})


def test_extra_args_may_not_set_the_managed_flags() -> None:
    for extra in (
        ["--speculative-algorithm", "ngram"],
        ["--speculative-num-draft-tokens=8"],
        ["--speculative-draft-model-path", HEAD],
    ):
        with pytest.raises(SpecError, match="may not set --speculative"):
            plan(owner({"model": "m", "engine": {"extraArgs": extra}}), Cluster())
    # The ngram windows have no field: they pass through.
    tuned = {
        "speculative": {"algorithm": "ngram"},
        "extraArgs": ["--speculative-ngram-max-match-window-size", "8"],
    }
    assert flags(make({"model": "m", "engine": tuned})).speculative_ngram_max_match_window_size == 8


# --- against a real API server: the schema and its CEL rules as the cluster enforces them


def _ms(speculative: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": "spec", "namespace": "default"},
        "spec": {"model": "Qwen/Qwen3-8B", "engine": {"speculative": speculative}},
    }


@pytest.mark.k8s
def test_the_api_server_enforces_the_same_rules(cluster: Api) -> None:
    install_modelserver_crd(cluster)
    good = {"algorithm": "eagle3", "numDraftTokens": 3, "draftModelPath": HEAD}
    resp = cluster.create(_ms(good), dry_run=True)
    assert resp.status_code == 201, resp.text
    stored = resp.json()["spec"]
    assert stored["engine"]["speculative"] == good
    assert parse_spec("spec", "default", stored).engine.speculative == spec.SpeculativeSpec(
        "eagle3", 3, HEAD
    )
    for bad, message in REFUSED.values():
        validate_or_cel_fails = cluster.create(_ms(bad), dry_run=True)
        assert validate_or_cel_fails.status_code == 422, (bad, validate_or_cel_fails.text)
        # The schema's own wording differs from the operator's for the plain bounds and enums;
        # the cross-field rules carry the operator's message.
        if "draftModelPath" in message:
            assert message in validate_or_cel_fails.json()["message"], validate_or_cel_fails.text
