"""Trim an upstream CRD to what the tests validate against: the served storage version only,
no descriptions, and (for LeaderWorkerSet) its pod templates left open, since the tests
validate those as core PodTemplates with kubernetes-validate instead.

    python tests/k8s/crds/trim.py UPSTREAM.yaml SOURCE-NOTE > tests/k8s/crds/NAME.yaml
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

OPEN = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
# Pod templates and claim templates inside a LeaderWorkerSet: validated as core kinds.
OPEN_KEYS = ("leaderTemplate", "workerTemplate", "volumeClaimTemplates")


def trim(node: Any) -> Any:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k == "description" and isinstance(v, str):
                continue
            if k == "properties" and isinstance(v, dict):
                out[k] = {p: OPEN if p in OPEN_KEYS else trim(s) for p, s in v.items()}
                continue
            out[k] = trim(v)
        return out
    if isinstance(node, list):
        return [trim(x) for x in node]
    return node


class _NoAliases(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


def main() -> None:
    src, note = sys.argv[1], sys.argv[2]
    with open(src) as f:
        crd = yaml.safe_load(f)
    crd["spec"]["versions"] = [trim(v) for v in crd["spec"]["versions"] if v.get("storage")]
    crd["metadata"] = {"name": crd["metadata"]["name"]}
    print(f"# Trimmed from {note} by tests/k8s/crds/trim.py (Apache-2.0 upstream).")
    print(yaml.dump(crd, Dumper=_NoAliases, sort_keys=False, width=100), end="")


if __name__ == "__main__":
    main()
