#!/usr/bin/env bash
# Sets up .venv with the pinned CPU stack and the `llmops` command. Safe to run again: when the
# pins have not changed since the last successful setup it only re-checks and returns.
#
#   bash infra/local/setup.sh        (what `make run` and `make test` call)
#
# Never pulls CUDA: every package is pinned in infra/constraints-cpu.txt and installed with --no-deps (no resolver,
# so nothing can drag in torch's CUDA build or nvidia-* wheels) and --require-hashes from infra/hashes/cpu.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3.11}
VENV=.venv
PIN_FILE=infra/constraints-cpu.txt
STAMP=$VENV/.llmops-setup
HASH_FILE=infra/hashes/cpu.txt
want=$(cat "$PIN_FILE" "$HASH_FILE" infra/hashes/pip.txt pyproject.toml infra/hashes/perf-analyzer.txt infra/local/perf_analyzer.sh infra/local/platform.sh | sha256sum | cut -d' ' -f1)

say() { printf 'setup: %s\n' "$*"; }

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/llmops" ]; then
  say "environment is up to date ($VENV)"
  exit 0
fi

# pip unpacks every wheel under TMPDIR: on the repository's disk, not a /tmp that may be small (CI once
# ran out of space there with the three setups side by side). Removed when the setup ends.
export TMPDIR="$PWD/build/tmp/venv"
mkdir -p "$TMPDIR"
trap 'rm -rf "$TMPDIR"' EXIT

if ! "$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; then
  echo "setup: error: $PYTHON is not Python 3.11 (set PYTHON=/path/to/python3.11)" >&2
  exit 2
fi

# Every file pip installs must have one of the sha256 of infra/hashes/ (--require-hashes), made from the pins by
# infra/pin_hashes.py: a pin changed without them is refused here, before anything is installed.
"$PYTHON" infra/pin_hashes.py --check cpu pip

[ -x "$VENV/bin/python" ] || { say "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
# A current pip: the 23.x that a fresh 3.11 venv ships is slow with large pinned sets.
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --require-hashes -r infra/hashes/pip.txt
say "installing $(grep -c '==' "$PIN_FILE") pinned packages (no dependency resolution, CPU only)"
"$VENV/bin/python" -m pip install --quiet --quiet --disable-pip-version-check --no-deps --no-compile --progress-bar off --require-hashes -r "$HASH_FILE"
# No byte-compiling here (pip's --no-compile, and no compileall): Python compiles a module when it is first
# imported and keeps the .pyc, so only what runs is compiled. Compiling every installed file (compileall -j 0,
# as before) was about 40 s of both cores for .venv alone, mostly torch, transformers and vLLM files no run imports.
# (Unless PYTHONDONTWRITEBYTECODE is set: the Makefile's targets unset it.)
# setuptools warns on every editable install that a folder named like the package may shadow it (a 9-line
# BuildBackendWarning, command/editable_wheel.py); this project's packages are those folders. That one is filtered.
PYTHONWARNINGS="ignore:Editable installation:UserWarning" \
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .

cuda=$("$VENV/bin/python" -m pip list --format=freeze 2>/dev/null | grep -iE '^(nvidia-[a-z0-9-]+-cu[0-9]+|nvidia-(cublas|cudnn|cuda|nccl|cusparse|cufft|curand|cusolver|nvjitlink|nvtx)|cuda-|triton==)' || true)
if [ -n "$cuda" ]; then
  echo "setup: error: CUDA packages found in $VENV, refusing a CPU setup with them: $(echo $cuda)" >&2
  exit 1
fi
if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(0 if torch.version.cuda is None else 1)'; then
  echo "setup: error: torch in $VENV is a CUDA build; expected the CPU wheel pinned in $PIN_FILE" >&2
  exit 1
fi

# The only accepted `pip check` findings: llamafactory's torchvision/torchaudio requirements (docs/development.md, "the pip check exception").
problems=$("$VENV/bin/python" -m pip check 2>&1 | grep -vE '^llamafactory [0-9.]+ requires (torchvision|torchaudio), which is not installed\.$' | grep -v '^No broken requirements found' || true)
if [ -n "$problems" ]; then
  echo "setup: error: pip check found broken requirements:" >&2
  echo "$problems" >&2
  exit 1
fi

bash infra/local/perf_analyzer.sh

echo "$want" > "$STAMP"
say "done: $VENV/bin/llmops ($("$VENV/bin/llmops" --help >/dev/null && echo ok))"
