#!/usr/bin/env bash
# Provides `perf_analyzer` (which genai-perf drives) in .venv/bin. Called by setup.sh.
#
# Where glibc >= 2.38 the PyPI wheel installs as usual. Its binary needs glibc 2.38 and
# GLIBCXX_3.4.32; on Debian 12 (glibc 2.36) pip only finds an empty 0.1.0. There, the wheel's
# binary is unpacked and started through Debian 13's dynamic loader with Debian 13's libc,
# libstdc++, libgcc, libssl and zlib unpacked (apt-get download + dpkg-deb -x) into a private
# folder: no system library is changed, nothing else sees those libraries.
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV=.venv
HASHES=infra/hashes/perf-analyzer.txt  # its pin (infra/constraints-perf-analyzer.txt) with the sha256 of its files
VERSION=$(sed -n 's/^perf-analyzer==\([^ ]*\).*/\1/p' infra/constraints-perf-analyzer.txt)
ROOT=$VENV/perf_analyzer
WRAPPER=$VENV/bin/perf_analyzer
say() { printf 'setup: perf_analyzer: %s\n' "$*"; }

if [ -x "$WRAPPER" ] && "$WRAPPER" --version >/dev/null 2>&1; then
  exit 0
fi

source infra/local/platform.sh
glibc=$(glibc_version)
if glibc_at_least 2.38; then
  say "glibc $glibc: installing the perf-analyzer wheel"
  "$VENV/bin/python" -m pip install --quiet --no-deps --require-hashes -r "$HASHES"
  exit 0
fi

say "glibc $glibc < 2.38: unpacking perf_analyzer $VERSION with Debian 13 runtime libraries into $ROOT"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$VENV/bin/python" -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux_2_38_x86_64 \
  --python-version 3.11 -d "$work" --require-hashes -r "$HASHES"
rm -rf "$ROOT" && mkdir -p "$ROOT/bin" "$ROOT/sysroot"
"$VENV/bin/python" -m zipfile -e "$work"/perf_analyzer-*.whl "$work/wheel"
install -m 755 "$work/wheel/perf_analyzer/bin/perf_analyzer" "$ROOT/bin/perf_analyzer"

# A private apt state that reads Debian 13 (trixie) from the same mirror the system uses.
mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
[ -n "$mirror" ] || mirror=$(awk '/^deb / {print $2; exit}' /etc/apt/sources.list)
mkdir -p "$work/apt/lists/partial" "$work/apt/archives/partial"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-trixie-stable.gpg] $mirror trixie main" > "$work/apt/sources.list"
apt_opts=(-o "Dir::Etc::SourceList=$work/apt/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
          -o "Dir::State::Lists=$work/apt/lists" -o "Dir::Cache::Archives=$work/apt/archives"
          -o "Dir::State::status=/dev/null" -o "APT::Get::List-Cleanup=0" -o "APT::Sandbox::User=root")
apt-get "${apt_opts[@]}" -qq update
(cd "$work" && apt-get "${apt_opts[@]}" -qq download libc6 libstdc++6 libgcc-s1 libssl3t64 zlib1g)
for deb in "$work"/*.deb; do dpkg-deb -x "$deb" "$ROOT/sysroot"; done

lib="$ROOT/sysroot/usr/lib/x86_64-linux-gnu"
root_abs=$(cd "$ROOT" && pwd)
cat > "$WRAPPER" <<WRAP
#!/bin/sh
# perf_analyzer $VERSION through Debian 13's loader and libraries (see infra/local/perf_analyzer.sh)
lib="$root_abs/sysroot/usr/lib/x86_64-linux-gnu"
exec "\$lib/ld-linux-x86-64.so.2" --library-path "\$lib" "$root_abs/bin/perf_analyzer" "\$@"
WRAP
chmod +x "$WRAPPER"
"$WRAPPER" --version >/dev/null 2>&1 || { echo "setup: error: perf_analyzer does not start: $("$WRAPPER" --version 2>&1 | tail -1)" >&2; exit 1; }
say "ok ($WRAPPER)"
