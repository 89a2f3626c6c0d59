#!/usr/bin/env bash
# Installs minisgl and its test tools into ./.venv. torch is pinned first: an unpinned torch
# would pull a multi-GB CUDA build where a CPU one is wanted.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[dev]'
# Debian's Prometheus (promtool and a real server for the metrics tests), when apt is usable.
if ! command -v prometheus >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null) \
    || echo "warning: could not install prometheus; metrics tests that need it will skip" >&2
fi
