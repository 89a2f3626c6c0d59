#!/usr/bin/env bash
# The test suite (README "Test"), with a throwaway Kubernetes control plane for the cluster
# tests: etcd, kube-apiserver and kube-controller-manager on free loopback ports (no kubelet),
# started before pytest and stopped after it, also when tests fail or are interrupted.
#
#   bash scripts/test.sh [PYTEST ARGS]      # default: -q
#
# MINISGL_CONTROL_PLANE names the `control-plane` script (up|down; it prints the KUBECONFIG
# export), with the upstream CRDs the tests need in crds/ beside it. Set it empty to test
# against the cluster KUBECONFIG already names instead (the tests create namespaces, CRDs and
# cluster roles there: use a scratch cluster).
set -euo pipefail
cd "$(dirname "$0")/.."
control_plane=${MINISGL_CONTROL_PLANE-../shared/k8s/control-plane}

if [ -n "$control_plane" ]; then
  if [ -x "$control_plane" ]; then
    trap '"$control_plane" down' EXIT
    exports=$("$control_plane" up)  # `export KUBECONFIG=...` (an assignment: set -e sees a failure)
    eval "$exports"                 # pytest inherits KUBECONFIG
    export MINISGL_K8S_CRDS=${MINISGL_K8S_CRDS:-$(cd "$(dirname "$control_plane")" && pwd)/crds}
  else
    echo "scripts/test.sh: no control plane at $control_plane (MINISGL_CONTROL_PLANE):" \
      "the cluster tests skip (and fail when CI is set)" >&2
  fi
fi

.venv/bin/python -m pytest "${@:--q}"
