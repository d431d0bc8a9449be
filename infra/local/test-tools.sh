#!/usr/bin/env bash
# Debian packages the integration tests start for real, installed when missing:
#   chromium         the browser test of the Prefect UI (driven by playwright, which downloads no browser)
#   postgresql       the service tests run the stack on PostgreSQL (`llmops stack up --db postgres`)
#   prometheus       scrapes a real Triton in the serving tests; a canary step reads its checks from it
#
#   bash infra/local/test-tools.sh   (what `make test` calls; needs root or sudo only when something is missing)
set -euo pipefail

missing=()
[ -x /usr/bin/chromium ] || missing+=(chromium)
compgen -G '/usr/lib/postgresql/*/bin/postgres' >/dev/null || missing+=(postgresql)
[ -x /usr/bin/prometheus ] || missing+=(prometheus)
if [ ${#missing[@]} -eq 0 ]; then
  echo "test-tools: chromium, postgresql and prometheus are installed"
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  run=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  run=(sudo -n)
else
  echo "test-tools: error: missing Debian packages: ${missing[*]}; install them: sudo apt-get install -y ${missing[*]}" >&2
  exit 2
fi
echo "test-tools: installing ${missing[*]} (apt-get)"
"${run[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
"${run[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
echo "test-tools: installed ${missing[*]}"
