#!/usr/bin/env bash
# Runs the test suite: installs nvfp4_jax with its test extras into .venv, then pytest.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k hadamard`.
set -euo pipefail
source "$(dirname "$0")/setup_venv.sh" "[test]"
exec .venv/bin/python -m pytest -n "${NVFP4_TEST_WORKERS:-auto}" "$@"
