"""The endpoint picker the operator pins understands the command line the operator gives it.

`operator/minisgl_operator/epp_flags.yaml` lists the flags of the pinned release, as its source
at that tag defines them; the picker (Go) exits at once on a flag it does not define.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from k8s_support import CHART
from minisgl_operator import routing
from minisgl_operator.spec import parse_spec

EPP_FLAGS = Path(routing.__file__).with_name("epp_flags.yaml")


def pinned() -> dict[str, Any]:
    return yaml.safe_load(EPP_FLAGS.read_text())


def test_the_flag_list_is_for_the_pinned_release() -> None:
    data = pinned()
    assert data["image"] == routing.DEFAULT_EPP_IMAGE
    assert data["image"].endswith(f":{data['upstream']['tag']}")
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["operator"]["endpointPicker"]["image"] == routing.DEFAULT_EPP_IMAGE
    assert data["upstream"]["repository"] == "kubernetes-sigs/gateway-api-inference-extension"
    assert len(data["upstream"]["commit"]) == 40 and data["upstream"]["path"]


def rendered_flags(args: list[str]) -> list[tuple[str, str | None]]:
    """(name, value) per flag word: the value after `=`, or the next word, or None."""
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(args):
        word = args[i]
        assert word.startswith("--"), f"{word!r} is not a flag (a value without its flag?)"
        name, eq, value = word[2:].partition("=")
        if eq:
            out.append((name, value))
            i += 1
        else:
            out.append((name, args[i + 1] if i + 1 < len(args) else None))
            i += 2
    return out


def test_every_flag_the_operator_renders_is_defined_by_the_pinned_release() -> None:
    flags = pinned()["flags"]
    spec = parse_spec("qwen", "llm", {"model": "m", "routing": {"inferencePool": True}})
    args = routing.epp_args(spec, ())
    rendered = rendered_flags(args)
    assert {name for name, _ in rendered} >= {"pool-name", "pool-namespace"}
    for name, value in rendered:
        assert name in flags, f"--{name}: not a flag of {routing.DEFAULT_EPP_IMAGE}"
        if flags[name] == "bool":  # `--flag false` would leave "false" as a stray argument
            assert f"--{name}={value}" in args and value in ("true", "false"), name
        else:
            assert value is not None, f"--{name} has no value"


def test_the_chart_example_picker_flags_are_defined_too() -> None:
    # values.yaml suggests extraArgs like ["--v", "3"]: the picker must know them.
    text = (CHART / "values.yaml").read_text()
    assert '["--v", "3"]' in text
    assert "v" in pinned()["flags"]
