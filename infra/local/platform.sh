#!/usr/bin/env bash
# Platform detection for the setup scripts, without pipelines: under `set -o pipefail` a pipeline
# whose reader exits early (`ldd --version | head -1`) kills its writer with SIGPIPE and the whole
# setup with exit 141, at random. Each value here is read by one command into a variable.
#
#   source infra/local/platform.sh; glibc_version; glibc_at_least 2.38
#   bash infra/local/platform.sh     # prints "glibc <version> <at-least-2.38: yes|no>"
set -euo pipefail

# The C library's version, e.g. "2.36" (getconf asks the running glibc itself).
glibc_version() {
  local answer
  answer=$(getconf GNU_LIBC_VERSION)   # "glibc 2.36"
  printf '%s\n' "${answer##* }"
}

# True when the running glibc is at least MAJOR.MINOR.
glibc_at_least() {
  local have want have_major have_minor want_major want_minor
  have=$(glibc_version)
  want=$1
  have_major=${have%%.*} have_minor=${have#*.}
  want_major=${want%%.*} want_minor=${want#*.}
  have_minor=${have_minor%%.*} want_minor=${want_minor%%.*}
  ((have_major > want_major || (have_major == want_major && have_minor >= want_minor)))
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  if glibc_at_least 2.38; then at_least=yes; else at_least=no; fi
  printf 'glibc %s %s\n' "$(glibc_version)" "$at_least"
fi
