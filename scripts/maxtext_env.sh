#!/usr/bin/env bash
# Makes .maxtext-venv in the repo root: MaxText (maxtext 0.2.5, which needs Python >= 3.12 and
# jax >= 0.11) on the CPU JAX, qwix, and nvfp4_jax (editable, with its [test] extra), about
# 1.6 GB. tests/integration/test_maxtext.py trains a tiny MaxText decoder in it. Then:
#   bash scripts/test.sh -m maxtext -n 0
# PYTHON picks the interpreter (default: the first Python >= 3.12 found); NVFP4_MAXTEXT_PYTHON
# points the test at another MaxText environment instead.
set -euo pipefail
cd "$(dirname "$0")/.."
# The interpreter: PYTHON, else the first Python >= 3.12 of python3.12, python3.13, pyenv's.
python=""
root=${PYENV_ROOT:-$HOME/.pyenv}
for candidate in "${PYTHON:-}" python3.12 python3.13 "$root"/versions/3.1[23]*/bin/python3; do
  if [ -n "$candidate" ] &&
    "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2> /dev/null; then
    python=$candidate
    break
  fi
done
if [ -z "$python" ]; then
  echo "MaxText needs Python >= 3.12: set PYTHON=/path/to/python3.12 and run again." >&2
  exit 1
fi
# nvfp4_jax with its test extra (scripts/setup_venv.sh: the native kernels against this jaxlib).
PYTHON=$python NVFP4_VENV=.maxtext-venv source scripts/setup_venv.sh "[test]"
# MaxText's wheel declares no base dependencies (only its cuda12 / tpu extras, with GPU or TPU
# JAX and torch); these are the ones its trainer (maxtext.trainers.pre_train.train) imports.
.maxtext-venv/bin/python -m pip install -q "maxtext==0.2.5" "jax>=0.11" "jaxlib>=0.11" flax \
  optax orbax-checkpoint "qwix>=0.1.8,<0.2" aqtp absl-py omegaconf pydantic grain tensorboardx \
  sentencepiece tiktoken transformers pathwaysutils jinja2 tokamax drjax pillow sympy
.maxtext-venv/bin/python -c 'import maxtext.trainers.pre_train.train, nvfp4_jax.maxtext'
echo "MaxText environment ready in .maxtext-venv: run bash scripts/test.sh -m maxtext -n 0"
