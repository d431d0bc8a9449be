#!/usr/bin/env bash
# Downloads the wheels `make gpu-smoke` installs on a GPU machine (infra/gpu/smoke-wheels.txt) into .whl/:
# CPython 3.12, x86_64 Linux, no dependencies (the list names them all). bitsandbytes ships one library per
# CUDA and ROCm release (43 MB); only the CUDA 13.0 one (the GPU image's torch is a cu130 build) and the CPU one
# are kept, which brings everything under the 64 MiB a device call may carry.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${1:-.whl}
KEEP_CUDA=${BNB_CUDA:-130}
mkdir -p "$DEST"
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$DEST" -r infra/gpu/smoke-wheels.txt
python3 infra/gpu/slim_wheel.py "$DEST"/bitsandbytes-*.whl --keep "libbitsandbytes_cpu.so" --keep "libbitsandbytes_cuda${KEEP_CUDA}.so" \
  --drop 'bitsandbytes/libbitsandbytes_*.so'
du -ch "$DEST"/*.whl | tail -1 | sed 's/^/smoke-wheels: /'
