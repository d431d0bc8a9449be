#!/usr/bin/env bash
# make gpu-smoke and make gpu-bench: installs the carried wheels (.whl/, from `make gpu-smoke-wheels`) into a folder
# of their own, never over the image's packages, and runs benchmarks/$GPU_SCRIPT.py (gpu_smoke unless said) with the
# image's Python. The JSON goes to $OUT (the device tool's output folder) or build/.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
SITE=${GPU_SMOKE_SITE:-/tmp/llmops-gpu-smoke-site}
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
SCRIPT=${GPU_SCRIPT:-gpu_smoke}
exec "$PYTHON" "benchmarks/$SCRIPT.py" --out "${OUT:-build}/$SCRIPT.json" "$@"
