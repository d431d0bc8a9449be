#!/usr/bin/env bash
# Sets up .venv-compat: the serving images' transformers 4.x (no torch), in which
# tests/unit/test_serving_compat.py loads a merged model folder the way the serving runtime will.
# Safe to run again: when the pins have not changed since the last successful setup it only
# re-checks and returns.
#
#   bash infra/local/setup-compat.sh        (what `make setup-compat` and `make test` call)
#
# Every package is pinned in infra/constraints-compat.txt and installed with --no-deps --require-hashes from
# infra/hashes/compat.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3.11}
VENV=.venv-compat
PIN_FILE=infra/constraints-compat.txt
STAMP=$VENV/.llmops-setup
HASH_FILE=infra/hashes/compat.txt
want=$(cat "$PIN_FILE" "$HASH_FILE" infra/local/setup-compat.sh | sha256sum | cut -d' ' -f1)

say() { printf 'setup-compat: %s\n' "$*"; }

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  say "environment is up to date ($VENV)"
  exit 0
fi

# pip unpacks every wheel under TMPDIR: on the repository's disk, not a /tmp that may be small (CI once
# ran out of space there with the three setups side by side). Removed when the setup ends.
export TMPDIR="$PWD/build/tmp/venv-compat"
mkdir -p "$TMPDIR"
trap 'rm -rf "$TMPDIR"' EXIT

if ! "$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; then
  echo "setup-compat: error: $PYTHON is not Python 3.11 (set PYTHON=/path/to/python3.11)" >&2
  exit 2
fi

# Every file pip installs must have one of the sha256 of infra/hashes/ (--require-hashes), made from the pins by
# infra/pin_hashes.py: a pin changed without them is refused here, before anything is installed.
"$PYTHON" infra/pin_hashes.py --check compat

[ -x "$VENV/bin/python" ] || { say "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
say "installing $(grep -c '==' "$PIN_FILE") pinned packages (no dependency resolution, no torch)"
"$VENV/bin/python" -m pip install --quiet --quiet --disable-pip-version-check --no-deps --no-compile --progress-bar off --require-hashes -r "$HASH_FILE"
# No byte-compiling here (pip's --no-compile, and no compileall): Python compiles a module when it is first
# imported and keeps the .pyc, so only what runs is compiled. Compiling every installed file (compileall -j 0,
# as before) was about 40 s of both cores for .venv alone, mostly torch, transformers and vLLM files no run imports.
# (Unless PYTHONDONTWRITEBYTECODE is set: the Makefile's targets unset it.)

problems=$("$VENV/bin/python" -m pip check 2>&1 | grep -v '^No broken requirements found' || true)
if [ -n "$problems" ]; then
  echo "setup-compat: error: pip check found broken requirements:" >&2
  echo "$problems" >&2
  exit 1
fi

want_transformers=$(sed -n 's/^transformers==//p' "$PIN_FILE")
TRANSFORMERS_VERBOSITY=error "$VENV/bin/python" - "$want_transformers" <<'PY'
import sys

import jinja2  # noqa: F401  (chat templates)
import transformers
from transformers import AutoConfig, AutoTokenizer  # noqa: F401

assert transformers.__version__ == sys.argv[1], f"transformers {transformers.__version__}, pinned {sys.argv[1]}"
PY

echo "$want" > "$STAMP"
say "done: $VENV (transformers $want_transformers, $(du -sh "$VENV" | cut -f1))"
