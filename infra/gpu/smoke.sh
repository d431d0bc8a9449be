#!/usr/bin/env bash
# make gpu-smoke: installs the carried wheels (.whl/, from `make gpu-smoke-wheels`) into a folder of their own,
# never over the image's packages, and runs benchmarks/gpu_smoke.py with the image's Python. The JSON goes to
# $OUT (the device tool's output folder) or build/.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
SITE=${GPU_SMOKE_SITE:-/tmp/llmops-gpu-smoke-site}
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
exec "$PYTHON" benchmarks/gpu_smoke.py --out "${OUT:-build}/gpu_smoke.json" "$@"
