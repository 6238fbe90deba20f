#!/usr/bin/env bash
# The main job: installs nvfp4_jax into .venv, then runs the example.
# Extra arguments go to the example.
set -euo pipefail
source "$(dirname "$0")/setup_venv.sh"
exec .venv/bin/python examples/quantize_demo.py "$@"
