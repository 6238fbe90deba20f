# Sourced by main.sh and test.sh: makes .venv in the repo root (reused on later runs) and
# installs nvfp4_jax into it, building the native kernels when a C++ compiler is present.
# Usage: source scripts/setup_venv.sh [EXTRAS]   e.g. EXTRAS="[test]"
# PYTHON picks the interpreter, NVFP4_VENV the folder (default .venv); NVFP4_NO_NATIVE=1 installs
# the Python package without the native kernels (the documentation build's environment).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "nvfp4_jax needs Python >= 3.11; $python is $("$python" --version 2>&1)." >&2
  echo "Set PYTHON=/path/to/python3.11 and run again." >&2
  exit 1
fi
venv=${NVFP4_VENV:-.venv}
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
# The build reads the XLA FFI headers from the installed jaxlib, so install the build
# requirements into the venv and build without isolation (no second jaxlib download).
"$venv/bin/python" -m pip install -q "scikit-build-core>=0.10" "jax>=0.10" "jaxlib>=0.10"
# NVFP4_NO_NATIVE=1: the Python package without the native kernels (the documentation build
# needs none), in a build folder of its own so that the environments with kernels keep theirs.
build_args=()
if [ "${NVFP4_NO_NATIVE:-0}" = 1 ]; then
  build_args=(-C cmake.define.NVFP4_NATIVE=OFF -C "build-dir=build/python-only/{wheel_tag}")
fi
"$venv/bin/python" -m pip install -q --no-build-isolation ${build_args[@]+"${build_args[@]}"} \
  -e ".${1:-}"
