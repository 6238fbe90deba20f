#!/usr/bin/env bash
# Makes .maxtext-venv in the repo root: MaxText (maxtext 0.2.5, which needs Python >= 3.12 and
# jax >= 0.11) on the CPU JAX, qwix, and nvfp4_jax (editable, with its [test] extra), about
# 1.6 GB, then proves it: one training step of a tiny MaxText decoder in NVFP4 through the
# launcher (`python -m nvfp4_jax.maxtext`, as docs/guides/maxtext.md runs it), failing the
# script if that step fails or trains nothing in NVFP4. tests/integration/test_maxtext.py
# trains a tiny MaxText decoder in it. Then:
#   bash scripts/test.sh -m maxtext -n 0
# PYTHON picks the interpreter (default: the first Python >= 3.12 found); NVFP4_MAXTEXT_VENV
# the folder (default .maxtext-venv; the tests then need NVFP4_MAXTEXT_PYTHON=FOLDER/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${NVFP4_MAXTEXT_VENV:-.maxtext-venv}
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
# nvfp4_jax with its test extra (scripts/setup_venv.sh: the native kernels against this jaxlib),
# built in a folder of its own: .venv-newest's build (the same wheel tag, another jaxlib) would
# otherwise share build/cp312-..., and two builds at once break each other.
export SKBUILD_BUILD_DIR=build/maxtext-{wheel_tag}
PYTHON=$python NVFP4_VENV=$venv source scripts/setup_venv.sh "[test]"
# MaxText's wheel declares no base dependencies (only its cuda12 / tpu extras, with GPU or TPU
# JAX and torch); these are the ones its trainer (maxtext.trainers.pre_train.train) imports,
# ml_collections for its input pipeline, which the trainer imports only when it runs.
"$venv/bin/python" -m pip install -q "maxtext==0.2.5" "jax>=0.11" "jaxlib>=0.11" flax \
  optax orbax-checkpoint "qwix>=0.1.8,<0.2" aqtp absl-py omegaconf pydantic grain tensorboardx \
  sentencepiece tiktoken transformers pathwaysutils jinja2 tokamax drjax pillow sympy \
  ml_collections
# The proof: importing the trainer is not enough (its input pipeline and train loop import more
# when they run), so run one step of a tiny decoder, the guide's command with steps=1.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "One training step of a tiny MaxText decoder in NVFP4 through the launcher (CPU)"
if ! JAX_PLATFORMS=cpu "$venv/bin/python" -m nvfp4_jax.maxtext src/maxtext/configs/base.yml \
  run_name=env_check base_output_directory="$work/out" dataset_type=synthetic steps=1 \
  hardware=cpu skip_jax_distributed_system=True attention=dot_product \
  base_emb_dim=64 base_num_query_heads=4 base_num_kv_heads=4 base_mlp_dim=128 \
  base_num_decoder_layers=2 head_dim=16 vocab_size=256 max_target_length=32 \
  per_device_batch_size=2 enable_checkpointing=False \
  --nvfp4-report "$work/report.json" > "$work/log" 2>&1; then
  tail -n 40 "$work/log" >&2
  echo "The MaxText environment in $venv cannot train one step (the log's end above)." >&2
  exit 1
fi
# ... and the step trained in NVFP4: the report puts the decoder's projections in NVFP4.
"$venv/bin/python" - "$work/report.json" << 'EOF'
import json, sys

report = json.load(open(sys.argv[1]))
actions = [op["action"] for provider in report["providers"] for op in provider.values()]
if report["status"] != "completed" or "nvfp4" not in actions:
    sys.exit(f"the one-step check trained nothing in NVFP4: {report}")
print(f"one step: {actions.count('nvfp4')} ops in NVFP4, {len(actions)} intercepted")
EOF
echo "MaxText environment ready in $venv: run bash scripts/test.sh -m maxtext -n 0"
