#!/usr/bin/env bash
# Sets up .venv-lmeval: EleutherAI's lm-evaluation-harness (lm_eval 0.4.13), which scores a served model through its
# OpenAI API (`local-completions`, `local-chat-completions`). Safe to run again: when the pins have not changed
# since the last successful setup it only re-checks and returns.
#
#   bash infra/local/setup-lmeval.sh        (what `make setup-lmeval` and `make test` call)
#
# Never pulls CUDA or torch: every package is pinned in infra/constraints-lmeval.txt and installed with --no-deps
# and --require-hashes from infra/hashes/lmeval.txt (the API models need no torch; transformers reads only the
# tokenizer).
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3.11}
VENV=.venv-lmeval
PIN_FILE=infra/constraints-lmeval.txt
STAMP=$VENV/.llmops-setup
HASH_FILE=infra/hashes/lmeval.txt
want=$(cat "$PIN_FILE" "$HASH_FILE" infra/hashes/pip.txt infra/local/setup-lmeval.sh | sha256sum | cut -d' ' -f1)

say() { printf 'setup-lmeval: %s\n' "$*"; }

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/lm_eval" ]; then
  say "environment is up to date ($VENV)"
  exit 0
fi

# pip unpacks every wheel under TMPDIR: on the repository's disk, not a /tmp that may be small.
export TMPDIR="$PWD/build/tmp/venv-lmeval"
mkdir -p "$TMPDIR"
trap 'rm -rf "$TMPDIR"' EXIT

# Every file pip installs must have one of the sha256 of infra/hashes/ (--require-hashes), made from the pins by
# infra/pin_hashes.py: a pin changed without them is refused here, before anything is installed.
"$PYTHON" infra/pin_hashes.py --check lmeval pip

[ -x "$VENV/bin/python" ] || { say "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --require-hashes -r infra/hashes/pip.txt
# rouge_score, sqlitedict and word2number are sdists only: they are built with the pinned setuptools, installed
# first from its own hashed lines, not with one pip would fetch unchecked into an isolated build environment.
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --require-hashes -r <(sed -n '/^setuptools==/,/[^\\]$/p' "$HASH_FILE")
say "installing $(grep -c '^[^#]*==' "$PIN_FILE") pinned packages for lm_eval (no dependency resolution, no torch)"
"$VENV/bin/python" -m pip install --quiet --quiet --disable-pip-version-check --no-deps --no-build-isolation --no-compile --progress-bar off --require-hashes -r "$HASH_FILE"

cuda=$("$VENV/bin/python" -m pip list --format=freeze 2>/dev/null | grep -iE '^(torch|nvidia-(cu|cuda)[a-z0-9-]*|cuda-[a-z0-9-]+|triton)==' || true)
if [ -n "$cuda" ]; then
  echo "setup-lmeval: error: torch or CUDA packages found in $VENV, refusing them: $(echo $cuda)" >&2
  exit 1
fi
problems=$("$VENV/bin/python" -m pip check 2>&1 | grep -v '^No broken requirements found' || true)
if [ -n "$problems" ]; then
  echo "setup-lmeval: error: pip check found broken requirements:" >&2
  echo "$problems" >&2
  exit 1
fi
# The command line, and the two API models the project evaluates with, load with no network (tokenizer, datasets
# and the hub offline, as the tests run it; without torch transformers advises that models are unavailable).
HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 "$VENV/bin/lm_eval" --help >/dev/null
HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1 "$VENV/bin/python" -c \
  'import transformers, jinja2; from lm_eval.models.openai_completions import LocalCompletionsAPI, LocalChatCompletion'

echo "$want" > "$STAMP"
say "done: $VENV ($(du -sh "$VENV" | cut -f1))"
