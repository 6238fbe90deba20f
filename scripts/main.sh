#!/usr/bin/env bash
# The main job: installs nvfp4_jax into .venv, then trains the example language model with
# NVFP4 and bf16 side by side (examples/train_lm.py; extra arguments go to it, e.g.
# `bash scripts/main.sh --steps 2000 --width 256`). Results land in runs/train_lm/.
set -euo pipefail
source "$(dirname "$0")/setup_venv.sh" "[examples]"
exec .venv/bin/python examples/train_lm.py "$@"
