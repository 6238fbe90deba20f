#!/usr/bin/env bash
# Builds the documentation (docs/, Sphinx with MyST) into docs/_build/html, with warnings as
# errors: a broken link or reference, a public name without a docstring, or a docstring that
# does not parse fails the build. Installs nvfp4_jax with its docs extra into .venv first
# (NVFP4_VENV names another folder: scripts/test.sh builds in .venv-docs, which holds only
# the docs extra); with NVFP4_DOCS_NO_INSTALL=1 it uses the environment as it is. Nothing is
# fetched over the network while building.
# Extra arguments go to sphinx-build, e.g. `bash scripts/docs.sh -E` (rebuild every page).
set -euo pipefail
if [ "${NVFP4_DOCS_NO_INSTALL:-0}" != 1 ]; then
  source "$(dirname "$0")/setup_venv.sh" "[docs]"
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec "${NVFP4_VENV:-.venv}/bin/python" -m sphinx -W --keep-going -q -b html "$@" docs docs/_build/html
