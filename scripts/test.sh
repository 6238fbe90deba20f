#!/usr/bin/env bash
# Runs the test suite: installs nvfp4_jax with its test extras into .venv, then pytest, then
# the documentation build with warnings as errors (scripts/docs.sh, in .venv-docs with only
# the docs extra, as a user's fresh clone builds it). Extra arguments go to
# pytest, e.g. `bash scripts/test.sh -k hadamard`; NVFP4_SKIP_DOCS=1 skips the docs build
# (for a quick loop). The exit status is pytest's, or the docs build's if pytest passed.
#
# Then, where a Python >= 3.12 is present (NVFP4_NEWEST_PYTHON, python3.12, python3.13 or
# pyenv's), the core package's tests (the numerics of every op on every implementation),
# the public API, the precision schedule (high_precision_forward), the integrations' tests and
# the native kernels under JAX's default mesh and the tests that need XLA's own defaults (marked
# `newest`: qwix, Explicit axes, two tests that skip under tests/xla_setup.py's flags) run again in
# .venv-newest with the newest JAX that Python gets (jax 0.12 on 3.12 and 3.13; .venv has
# what Python 3.11 gets, jax 0.10), with XLA's defaults (tests/xla_setup.py). NVFP4_SKIP_NEWEST=1
# skips it; with pytest arguments given it is skipped too (a focused run). The MS-EDEN
# statistics (seconds of sampling each, bounds on numbers the bit tests already pin) run once.
set -euo pipefail
source "$(dirname "$0")/setup_venv.sh" "[test]"
status=0
.venv/bin/python -m pytest -n "${NVFP4_TEST_WORKERS:-auto}" --dist worksteal "$@" || status=$?
if [ "${NVFP4_SKIP_DOCS:-0}" != 1 ]; then
  # As the README builds it: `bash scripts/docs.sh`, which installs the docs extra, in an
  # environment of its own (.venv-docs) that holds nothing else, so that a module autodoc
  # needs and the docs extra lacks fails here, not on a user's fresh clone. -E: every page
  # read again, none from an earlier build's cache. Without the native kernels
  # (NVFP4_NO_NATIVE=1): the pages need none, and building them a third time took CI 2-3
  # minutes.
  echo "Building the documentation (scripts/docs.sh in .venv-docs; NVFP4_SKIP_DOCS=1 skips it)"
  if ! NVFP4_VENV=.venv-docs NVFP4_NO_NATIVE=1 bash scripts/docs.sh -E; then
    [ "$status" != 0 ] || status=1
  fi
fi

newest_python() {
  local root=${PYENV_ROOT:-$HOME/.pyenv}
  local candidates=("${NVFP4_NEWEST_PYTHON:-}" python3.12 python3.13)
  candidates+=("$root"/versions/3.12*/bin/python3 "$root"/versions/3.13*/bin/python3)
  local p
  for p in "${candidates[@]}"; do
    if [ -n "$p" ] && "$p" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2> /dev/null; then
      echo "$p"
      return 0
    fi
  done
  return 1
}

if [ "${NVFP4_SKIP_NEWEST:-0}" != 1 ] && [ "$#" = 0 ]; then
  if newest=$(newest_python); then
    echo "The newest JAX: core, public API and integrations' tests in .venv-newest ($newest)"
    if (PYTHON=$newest NVFP4_VENV=.venv-newest source scripts/setup_venv.sh "[test]") &&
      .venv-newest/bin/python -c 'import jax; print("jax", jax.__version__)' &&
      NVFP4_TEST_XLA_OPTIMIZE=1 .venv-newest/bin/python -m pytest \
        -n "${NVFP4_TEST_WORKERS:-auto}" --dist worksteal \
        -m "newest or not (integration or distributed)" \
        --ignore tests/core/test_ms_eden_statistics.py \
        tests/core tests/test_public_api.py tests/integration \
        tests/training/test_distributed.py tests/training/test_distributed_training.py \
        tests/training/test_recipe_precision.py; then
      :
    else
      [ "$status" != 0 ] || status=1
    fi
  else
    echo "No Python >= 3.12 found: the newest-JAX pass is skipped (set NVFP4_NEWEST_PYTHON)."
  fi
fi
exit "$status"
