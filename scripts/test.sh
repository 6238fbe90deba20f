#!/usr/bin/env bash
# Runs the test suite: installs nvfp4_jax with its test extras into .venv, then pytest, then
# the documentation build with warnings as errors (scripts/docs.sh). Extra arguments go to
# pytest, e.g. `bash scripts/test.sh -k hadamard`; NVFP4_SKIP_DOCS=1 skips the docs build
# (for a quick loop). The exit status is pytest's, or the docs build's if pytest passed.
set -euo pipefail
source "$(dirname "$0")/setup_venv.sh" "[test]"
status=0
.venv/bin/python -m pytest -n "${NVFP4_TEST_WORKERS:-auto}" "$@" || status=$?
if [ "${NVFP4_SKIP_DOCS:-0}" != 1 ]; then
  echo "Building the documentation (scripts/docs.sh; NVFP4_SKIP_DOCS=1 skips it)"
  if ! NVFP4_DOCS_NO_INSTALL=1 bash scripts/docs.sh; then
    [ "$status" != 0 ] || status=1
  fi
fi
exit "$status"
