#!/usr/bin/env bash
# Installs minisgl and its test tools into ./.venv, saying what it installs and why.
#
#   bash scripts/install.sh                  # picks the torch build for this machine
#   MINISGL_TORCH=cpu bash scripts/install.sh    # force the CPU build (or: cuda)
#   MINISGL_NO_APT=1 bash scripts/install.sh     # never touch system packages
#
# torch is installed first and pinned: an unpinned torch from the public index is the CUDA
# build on Linux (several GB of nvidia-* wheels), useless on a machine without an NVIDIA GPU.
# Sourcing this file (`source scripts/install.sh`) only defines the functions below.

TORCH_VERSION=2.13.0
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
MIN_PYTHON=3.10 # pyproject.toml's requires-python (a test keeps the two equal)
# Debian packages the test suite uses, and why (printed before anything is installed).
APT_PACKAGES=(
  "prometheus:promtool and a real Prometheus server for the metrics tests"
  "chromium:a headless browser for the playground tests (Playwright drives it)"
)

# Prints "cpu" or "cuda" on stdout and the reason on stderr.
torch_choice() {
  local forced="${MINISGL_TORCH:-auto}"
  case "$forced" in
    cpu | cuda)
      echo "torch: $forced build, as MINISGL_TORCH=$forced asks" >&2
      echo "$forced"
      return
      ;;
    auto | "") ;;
    *)
      echo "MINISGL_TORCH must be cpu, cuda or auto (got '$forced')" >&2
      return 2
      ;;
  esac
  local proc_dir="${MINISGL_NVIDIA_PROC_DIR:-/proc/driver/nvidia}"
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep '^GPU' >/dev/null; then
    echo "torch: CUDA build, because nvidia-smi lists a GPU ($(nvidia-smi -L | head -n 1))" >&2
    echo cuda
  elif [ -d "$proc_dir/gpus" ] && [ -n "$(ls -A "$proc_dir/gpus" 2>/dev/null)" ]; then
    echo "torch: CUDA build, because the NVIDIA driver reports a GPU in $proc_dir/gpus" >&2
    echo cuda
  else
    echo "torch: CPU build, because no NVIDIA driver is present (no working nvidia-smi, no $proc_dir/gpus); set MINISGL_TORCH=cuda to override" >&2
    echo cpu
  fi
}

# Can pip reach PyTorch's CPU index? Asked once, quickly: pip itself would retry every
# package it looks up there for seconds each.
cpu_index_reachable() {
  python3 - "$TORCH_CPU_INDEX/" >/dev/null 2>&1 <<'PY'
import sys
import urllib.request

urllib.request.urlopen(sys.argv[1], timeout=10)
PY
}

# The pip arguments that install torch for a choice ("cpu" or "cuda"), one per line.
torch_pip_args() {
  if [ "$1" != cpu ]; then
    echo "torch==$TORCH_VERSION" # PyPI's Linux build is the CUDA one
  elif cpu_index_reachable; then
    # An extra index, not a replacement: torch's own dependencies still come from the default
    # index, and pip prefers 2.13.0+cpu there over PyPI's CUDA 2.13.0 (a local version sorts
    # after its public one).
    echo "torch==$TORCH_VERSION"
    echo "--extra-index-url"
    echo "$TORCH_CPU_INDEX"
  else
    # Never fall back to PyPI's CUDA build: name the CPU build, which only pip's own
    # configuration (a local wheel, a mirror) can then provide, or pip fails saying so.
    echo "torch: $TORCH_CPU_INDEX is unreachable; asking for torch==$TORCH_VERSION+cpu, which pip's configuration (find-links, a mirror) must provide" >&2
    echo "torch==$TORCH_VERSION+cpu"
  fi
}

apt_usable() {
  command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]
}

# The Debian packages of APT_PACKAGES whose command is missing, one per line.
missing_apt_packages() {
  local entry name
  for entry in "${APT_PACKAGES[@]}"; do
    name="${entry%%:*}"
    command -v "$name" >/dev/null 2>&1 || echo "$name"
  done
}

install_apt_packages() {
  local missing
  missing="$(missing_apt_packages)"
  [ -n "$missing" ] || return 0
  if [ -n "${MINISGL_NO_APT:-}" ]; then
    echo "MINISGL_NO_APT is set: not installing $(echo "$missing" | tr '\n' ' ')(tests that need them skip)"
    return 0
  fi
  if ! apt_usable; then
    echo "apt-get is not usable here (not Debian/Ubuntu, or not root): not installing $(echo "$missing" | tr '\n' ' ')(tests that need them skip)"
    return 0
  fi
  echo "Installing Debian packages with apt-get (set MINISGL_NO_APT=1 to skip):"
  local entry name
  for entry in "${APT_PACKAGES[@]}"; do
    name="${entry%%:*}"
    if echo "$missing" | grep -qx "$name"; then
      echo "  - $name: ${entry#*:}"
    fi
  done
  if ! apt-get update -qq; then
    echo "warning: apt-get update failed; trying the package lists already on this machine" >&2
  fi
  # One package per call: a package this distribution lacks must not take the others with it.
  local failed=()
  for name in $missing; do
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$name" >/dev/null; then
      echo "warning: apt-get could not install $name; the tests that need it will skip" >&2
      failed+=("$name")
    fi
  done
  if [ "${#failed[@]}" -gt 0 ]; then
    echo "Not installed: ${failed[*]} (install by hand for the tests that need them)"
  fi
}

# Checks, before anything is created, that python3 is new enough and can make a virtual
# environment with pip in it; otherwise says what to install and returns 1. Debian and
# Ubuntu ship venv's pip bootstrap (ensurepip) apart from Python, in python3-venv.
check_python() {
  if ! command -v python3 >/dev/null 2>&1; then
    echo "error: python3 not found: install Python >= $MIN_PYTHON (Debian/Ubuntu: apt-get install python3 python3-venv)" >&2
    return 1
  fi
  local report version can_venv
  # Prints the version, then "venv" if a virtual environment with pip can be made.
  report="$(
    python3 - 2>/dev/null <<'PY'
import sys

print("%d.%d" % sys.version_info[:2])
try:
    import ensurepip
    import venv

    ensurepip.version()  # finds the bundled pip wheel, as venv will
    print("venv")
except Exception:
    print("no-venv")
PY
  )" || true
  { read -r version || true; read -r can_venv || true; } <<<"$report"
  if ! [[ "$version" =~ ^[0-9]+\.[0-9]+$ ]]; then
    echo "error: could not run python3 ($(command -v python3)) to read its version: install Python >= $MIN_PYTHON" >&2
    return 1
  fi
  if ! version_at_least "$version" "$MIN_PYTHON"; then
    echo "error: Python >= $MIN_PYTHON needed, found $version ($(command -v python3)): install a newer python3 and put it first on PATH" >&2
    return 1
  fi
  if [ "$can_venv" != venv ]; then
    echo "error: python3 $version cannot create a virtual environment with pip (no venv/ensurepip module): on Debian/Ubuntu run apt-get install python3-venv (or python$version-venv)" >&2
    return 1
  fi
  echo "python3 $version ($(command -v python3)) with venv"
}

# version_at_least A B: is the MAJOR.MINOR version A >= B?
version_at_least() {
  local a_major="${1%%.*}" a_minor="${1#*.}" b_major="${2%%.*}" b_minor="${2#*.}"
  [ "$a_major" -gt "$b_major" ] || { [ "$a_major" -eq "$b_major" ] && [ "$a_minor" -ge "$b_minor" ]; }
}

main() {
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  check_python
  local choice
  choice="$(torch_choice)"
  mapfile -t torch_args < <(torch_pip_args "$choice")
  python3 -m venv .venv
  echo "pip install ${torch_args[*]}"
  .venv/bin/pip install -q "${torch_args[@]}"
  echo "pip install -e .[dev]  (minisgl and its test tools)"
  .venv/bin/pip install -q -e '.[dev]'
  # Say what is installed now, not what was asked for.
  .venv/bin/python - "$choice" <<'PY'
import sys

import torch

cuda = torch.version.cuda
print(f"installed torch {torch.__version__} (CUDA: {cuda or 'none'})")
if sys.argv[1] == "cpu" and cuda:
    print("warning: a CUDA build of torch is installed although the CPU one was chosen")
PY
  install_apt_packages
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  main "$@"
fi
