#!/usr/bin/env bash
# Sets up .venv-aiperf: NVIDIA AIPerf, the load generator of bench.tool aiperf (genai-perf's successor). Safe to
# run again: when the pins have not changed since the last successful setup it only re-checks and returns.
#
#   bash infra/local/setup-aiperf.sh        (what `make setup-aiperf` and `make test` call)
#
# Never pulls CUDA or torch: every package is pinned in infra/constraints-aiperf.txt and installed with --no-deps
# and --require-hashes from infra/hashes/aiperf.txt (AIPerf reads tokenizers with transformers, which needs no torch
# for that).
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3.11}
VENV=.venv-aiperf
PIN_FILE=infra/constraints-aiperf.txt
STAMP=$VENV/.llmops-setup
HASH_FILE=infra/hashes/aiperf.txt
want=$(cat "$PIN_FILE" "$HASH_FILE" infra/hashes/pip.txt infra/local/setup-aiperf.sh | sha256sum | cut -d' ' -f1)

say() { printf 'setup-aiperf: %s\n' "$*"; }

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/aiperf" ]; then
  say "environment is up to date ($VENV)"
  exit 0
fi

# pip unpacks every wheel under TMPDIR: on the repository's disk, not a /tmp that may be small.
export TMPDIR="$PWD/build/tmp/venv-aiperf"
mkdir -p "$TMPDIR"
trap 'rm -rf "$TMPDIR"' EXIT

# Every file pip installs must have one of the sha256 of infra/hashes/ (--require-hashes), made from the pins by
# infra/pin_hashes.py: a pin changed without them is refused here, before anything is installed.
"$PYTHON" infra/pin_hashes.py --check aiperf pip

[ -x "$VENV/bin/python" ] || { say "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --require-hashes -r infra/hashes/pip.txt
say "installing $(grep -c '==' "$PIN_FILE") pinned packages for AIPerf (no dependency resolution, no torch)"
"$VENV/bin/python" -m pip install --quiet --quiet --disable-pip-version-check --no-deps --no-compile --progress-bar off --require-hashes -r "$HASH_FILE"

cuda=$("$VENV/bin/python" -m pip list --format=freeze 2>/dev/null | grep -iE '^(torch|nvidia-(cu|cuda)[a-z0-9-]*|cuda-[a-z0-9-]+|triton)==' || true)
if [ -n "$cuda" ]; then
  echo "setup-aiperf: error: torch or CUDA packages found in $VENV, refusing them: $(echo $cuda)" >&2
  exit 1
fi
problems=$("$VENV/bin/python" -m pip check 2>&1 | grep -v '^No broken requirements found' || true)
if [ -n "$problems" ]; then
  echo "setup-aiperf: error: pip check found broken requirements:" >&2
  echo "$problems" >&2
  exit 1
fi
"$VENV/bin/aiperf" --version >/dev/null

echo "$want" > "$STAMP"
say "done: $VENV ($(du -sh "$VENV" | cut -f1))"
