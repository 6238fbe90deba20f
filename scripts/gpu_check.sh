#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: builds the CUDA library, runs the test suite
# on the GPU, the CUDA kernel tests under compute-sanitizer, and the GPU benchmark, and
# writes every log and result under benchmarks/results/ (or --out), named after the GPU and
# the date. Needs no registry access: it installs this checkout into the given Python with
# `pip install --no-deps --no-build-isolation --no-index -e .` (jax with CUDA, cmake, ninja,
# scikit-build-core and pytest must already be there). Runs within 9 minutes: every step
# has a timeout, cut to what is left of the total.
#
# Without a GPU it checks what it can (the build, that the modules import, the benchmark
# script's arguments), says so and exits 2. Exit codes: 0 every step passed, 1 some step
# failed or timed out, 2 no GPU or bad arguments.
set -uo pipefail

usage() {
  cat <<'EOF'
usage: scripts/gpu_check.sh [options]

  --quick            shorter run: only the gpu-marked tests, memcheck only, a 4096 benchmark
  --skip-sanitizer   no compute-sanitizer runs
  --skip-build       use the installed build (fails if nvfp4_jax does not import)
  --assume-no-gpu    act as on a machine without a GPU (what CI tests)
  --out DIR          where logs and results go (default: benchmarks/results)
  --python PY        the Python to install into and run (default: python3)
  -h, --help         this text

Exit: 0 all passed, 1 a step failed or timed out, 2 no GPU (after the checks that need
none) or bad arguments.
EOF
}

bad_usage() {
  echo "gpu_check.sh: $1" >&2
  usage >&2
  exit 2
}

QUICK=0
SKIP_SANITIZER=0
SKIP_BUILD=0
ASSUME_NO_GPU=0
OUT=""
PY="python3"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) QUICK=1 ;;
    --skip-sanitizer) SKIP_SANITIZER=1 ;;
    --skip-build) SKIP_BUILD=1 ;;
    --assume-no-gpu) ASSUME_NO_GPU=1 ;;
    --out | --python)
      [[ $# -ge 2 && -n "$2" && "$2" != --* ]] || bad_usage "$1 needs a value"
      if [[ "$1" == --out ]]; then OUT="$2"; else PY="$2"; fi
      shift
      ;;
    --out=*) OUT="${1#--out=}" && [[ -n "$OUT" ]] || bad_usage "--out needs a value" ;;
    --python=*) PY="${1#--python=}" && [[ -n "$PY" ]] || bad_usage "--python needs a value" ;;
    -h | --help)
      usage
      exit 0
      ;;
    *) bad_usage "unknown argument: $1" ;;
  esac
  shift
done

command -v "$PY" >/dev/null 2>&1 || bad_usage "--python: $PY is not an executable"
PY="$(command -v "$PY")"
# Absolute (the script changes directory), symlinks kept (a venv's python is one).
[[ "$PY" == /* ]] || PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null ||
  bad_usage "--python: $PY is not a Python >= 3.11"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2

TOTAL_S=530 # 9 minutes for everything, less the kill grace of a timed-out step
START_S=$SECONDS
DATE="$(date +%Y-%m-%d)"

# --- the GPU -------------------------------------------------------------------------------

GPU_NAME=""
if [[ $ASSUME_NO_GPU -eq 0 ]] && command -v nvidia-smi >/dev/null 2>&1; then
  GPU_NAME="$(timeout 30 nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null |
    head -n 1 | sed 's/^ *//; s/ *$//')"
fi
if [[ -n "$GPU_NAME" ]]; then
  SLUG="gpu_$(echo "$GPU_NAME" | tr '[:upper:]' '[:lower:]' | sed 's/[^a-z0-9]\+/-/g; s/^-//; s/-$//')"
  OUT="${OUT:-$ROOT/benchmarks/results}"
else
  SLUG="nogpu"
  # Without a GPU nothing is a result: the logs go to a scratch folder unless --out says.
  OUT="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}"
  # Whatever the machine has, the checks below must not start a GPU backend.
  export JAX_PLATFORMS=cpu
fi
mkdir -p "$OUT" || bad_usage "--out: cannot create $OUT"
OUT="$(cd "$OUT" && pwd)"
PREFIX="$OUT/${SLUG}_${DATE}"
n=2
while [[ -e "${PREFIX}_summary.txt" ]]; do # a second run the same day keeps the first
  PREFIX="$OUT/${SLUG}_${DATE}_run$n"
  n=$((n + 1))
done

# What XLA needs beside compute-sanitizer and a test suite of many processes: allocate on
# demand, not 75% of the GPU per process.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-1}"

# --- steps ---------------------------------------------------------------------------------

STEPS=()
STATUS=()
SECS=()
LOGS=()

record() { # name status seconds log
  STEPS+=("$1")
  STATUS+=("$2")
  SECS+=("$3")
  LOGS+=("$4")
  printf '== %-22s %-28s %4ss  %s\n' "$1" "$2" "$3" "$4"
}

left_s() { echo $((TOTAL_S - (SECONDS - START_S))); }

# run_step NAME BUDGET_S LOG CMD...: runs CMD under `timeout`, for BUDGET_S seconds or what is
# left of the total (keeping `reserve` seconds for the steps after it), output to LOG.
# Sets STEP_RC (124 on timeout).
RESERVE_S=0
run_step() {
  local name="$1" budget="$2" log="$3"
  shift 3
  local left
  left=$(($(left_s) - RESERVE_S))
  [[ $left -lt $budget ]] && budget=$left
  if [[ $budget -lt 10 ]]; then
    record "$name" "SKIPPED (out of time)" 0 "-"
    STEP_RC=125
    return
  fi
  echo "== $name (up to ${budget}s): $*"
  local t0=$SECONDS
  {
    echo "# $(date -Iseconds) timeout ${budget}s: $*"
    timeout -k 10 "$budget" "$@"
  } >"$log" 2>&1
  STEP_RC=$?
  local took=$((SECONDS - t0))
  if [[ $STEP_RC -eq 0 ]]; then
    record "$name" "PASS" "$took" "$log"
  elif [[ $STEP_RC -eq 124 || $STEP_RC -eq 137 ]]; then
    record "$name" "TIMEOUT after ${budget}s" "$took" "$log"
  else
    record "$name" "FAIL (exit $STEP_RC)" "$took" "$log"
  fi
}

# Replace the last recorded status (a step whose exit code is not the whole story).
restatus() {
  local i=$((${#STATUS[@]} - 1))
  STATUS[i]="$1"
  printf '== %-22s %s\n' "${STEPS[i]}" "$1"
}

summary_and_exit() {
  local code="$1" headline="$2"
  {
    echo "# scripts/gpu_check.sh $(date -Iseconds)"
    echo "# machine: ${GPU_NAME:-no NVIDIA GPU}; python: $PY"
    echo "# options: quick=$QUICK skip_sanitizer=$SKIP_SANITIZER skip_build=$SKIP_BUILD" \
      "assume_no_gpu=$ASSUME_NO_GPU; total $((SECONDS - START_S))s of ${TOTAL_S}s"
    echo
    printf '| %-22s | %-28s | %6s | %s\n' step status seconds log
    printf '|%s|%s|%s|%s\n' "------------------------" "------------------------------" \
      "--------" "-----"
    local i
    for i in "${!STEPS[@]}"; do
      printf '| %-22s | %-28s | %6s | %s\n' "${STEPS[i]}" "${STATUS[i]}" "${SECS[i]}" \
        "${LOGS[i]#"$ROOT"/}"
    done
    echo
    echo "$headline"
  } >"${PREFIX}_summary.txt"
  echo
  echo "================ gpu_check summary ================"
  cat "${PREFIX}_summary.txt"
  echo "(written to ${PREFIX}_summary.txt)"
  exit "$code"
}

all_passed() {
  local s
  for s in "${STATUS[@]}"; do
    # A step skipped by an option is no failure; one skipped for want of time is.
    [[ "$s" == PASS* || "$s" == WARN* || "$s" == "SKIPPED (--"* ]] || return 1
  done
  return 0
}

# --- 1. tools ------------------------------------------------------------------------------

SANITIZER="$(command -v compute-sanitizer || true)"
for dir in "${CUDA_HOME:-}" /usr/local/cuda; do
  [[ -z "$SANITIZER" && -n "$dir" && -x "$dir/bin/compute-sanitizer" ]] &&
    SANITIZER="$dir/bin/compute-sanitizer"
done
NCU="$(command -v ncu || true)"
{
  echo "python: $PY ($("$PY" --version 2>&1))"
  "$PY" -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__)' 2>&1
  for tool in nvcc cmake ninja nvidia-smi; do
    echo "$tool: $(command -v "$tool" || echo missing)"
  done
  echo "compute-sanitizer: ${SANITIZER:-missing}"
  echo "ncu: ${NCU:-missing}"
  [[ -n "$GPU_NAME" ]] && timeout 30 nvidia-smi
} >"${PREFIX}_tools.log" 2>&1
record "tools" "PASS" 0 "${PREFIX}_tools.log"

# --- 2. build ------------------------------------------------------------------------------

if [[ $SKIP_BUILD -eq 1 ]]; then
  record "build" "SKIPPED (--skip-build)" 0 "-"
else
  # Keep the time the later steps need: without a GPU only the two checks below.
  BUILD_S=240
  RESERVE_S=$((QUICK ? 200 : 400))
  if [[ -z "$GPU_NAME" ]]; then
    BUILD_S=400
    RESERVE_S=60
  fi
  run_step "build" "$BUILD_S" "${PREFIX}_build.log" \
    "$PY" -m pip install --no-deps --no-build-isolation --no-index -v -e .
  RESERVE_S=0
fi

# --- 3. the modules import, and what they can run on -----------------------------------------

IMPORT_LOG="${PREFIX}_import.log"
GPU_EXPECTED="${GPU_NAME:+1}" run_step "import" 60 "$IMPORT_LOG" "$PY" - <<'EOF'
import importlib, os, shutil, sys
import jax
from nvfp4_jax import kernels
print("backend:", jax.default_backend(), jax.devices())
cpu = kernels.unavailable_reason("cpu")
print("cpu kernels:", "available" if not cpu else cpu)
try:
    cuda_module = importlib.import_module("nvfp4_jax._nvfp4_cuda")
    print("cuda module: built,", cuda_module.__file__)
    print("cuda probe:", repr(cuda_module.probe()))
except ImportError as error:
    cuda_module = None
    print("cuda module: not built:", error)
cuda = kernels.unavailable_reason("cuda")
print("cuda kernels:", "available" if not cuda else cuda)
failed = bool(cpu)
if cuda_module is None and shutil.which("nvcc"):
    print("FAIL: nvcc is on PATH but the CUDA module was not built")
    failed = True
if os.environ.get("GPU_EXPECTED") and jax.default_backend() != "gpu":
    print("FAIL: nvidia-smi sees a GPU but JAX has no GPU backend (jax without CUDA?)")
    failed = True
elif jax.default_backend() == "gpu" and cuda:
    print("FAIL: JAX runs on the GPU but the CUDA kernels cannot")
    failed = True
sys.exit(1 if failed else 0)
EOF

# --- 4. the benchmark script's arguments -----------------------------------------------------

BENCH=benchmarks/bench_gpu.py
bench_args_check() {
  "$PY" "$BENCH" --help || { echo "FAIL: $BENCH --help"; return 1; }
  "$PY" "$BENCH" --size 17
  [[ $? -eq 2 ]] || { echo "FAIL: $BENCH --size 17 must be rejected with exit 2"; return 1; }
  if [[ -z "$GPU_NAME" ]]; then
    "$PY" "$BENCH" --iters 1
    [[ $? -eq 2 ]] || { echo "FAIL: without a GPU $BENCH must exit 2"; return 1; }
  fi
  echo "$BENCH: arguments ok"
}
export -f bench_args_check
export PY BENCH GPU_NAME
run_step "bench args" 60 "${PREFIX}_bench_args.log" bash -c bench_args_check

if [[ -z "$GPU_NAME" ]]; then
  why="no NVIDIA GPU on this machine (nvidia-smi found none)"
  [[ $ASSUME_NO_GPU -eq 1 ]] && why="no GPU assumed (--assume-no-gpu)"
  if all_passed; then
    summary_and_exit 2 "NO GPU: $why; the build and the checks above passed. Run this on a GPU machine for the tests, sanitizer and benchmarks."
  fi
  summary_and_exit 2 "NO GPU: $why; and a check above FAILED."
fi

# --- 5. the test suite on the GPU ------------------------------------------------------------

PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rfE)
XDIST=()
"$PY" -c 'import xdist' 2>/dev/null && XDIST=(-n "${NVFP4_GPU_CHECK_WORKERS:-auto}")

# The CUDA implementation of every parametrized suite (the oracle suite included): a run in
# which the CUDA kernels were skipped everywhere is a failure, not a pass.
RESERVE_S=$((QUICK ? 100 : 330))
run_step "tests (gpu-marked)" $((QUICK ? 150 : 90)) "${PREFIX}_tests_gpu.log" \
  "${PYTEST[@]}" "${XDIST[@]}" -m gpu tests
if [[ $STEP_RC -eq 0 ]] && ! grep -qE '[0-9]+ passed' "${PREFIX}_tests_gpu.log"; then
  restatus "FAIL (no gpu test ran)"
fi
if [[ $QUICK -eq 0 ]]; then
  RESERVE_S=195
  run_step "tests (the rest)" 135 "${PREFIX}_tests.log" \
    "${PYTEST[@]}" "${XDIST[@]}" -m "not gpu" tests
fi
RESERVE_S=0

# --- 6. compute-sanitizer on the CUDA kernel tests --------------------------------------------

# One process (no xdist); every buffer its own allocation (XLA's pool would hide an overrun
# into a neighbour); no CUDA graphs or autotuning, which only slow the tools down.
sanitize() { # tool budget kernel-filter test-files...
  local tool="$1" budget="$2" filter="$3"
  shift 3
  local args=(--tool "$tool" --target-processes all --error-exitcode 99 --print-limit 100)
  # Older releases call the kernel filter --filter.
  if [[ -n "$filter" && -n "$KERNEL_FILTER" ]]; then
    args+=("$KERNEL_FILTER" "kns=$filter")
  fi
  XLA_PYTHON_CLIENT_ALLOCATOR=platform \
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer=" \
    run_step "sanitizer $tool" "$budget" "${PREFIX}_sanitizer_${tool}.log" \
    "$SANITIZER" "${args[@]}" "$PY" -m pytest -q -p no:cacheprovider -p no:xdist -x -m gpu "$@"
  if [[ $STEP_RC -eq 99 ]]; then
    restatus "FAIL ($tool found errors)"
  elif [[ $STEP_RC -eq 0 ]] && ! grep -qE '[0-9]+ passed' "${PREFIX}_sanitizer_${tool}.log"; then
    restatus "FAIL (no gpu test ran)"
  fi
}

# The MS-EDEN kernels' oracle cases (docs/NUMERICS.md section 14): their CUDA parameters.
MS_EDEN_ORACLE=tests/core/test_ms_eden.py::test_quantize_matches_the_oracle
KERNEL_FILTER=""
if [[ -n "$SANITIZER" ]]; then
  help="$("$SANITIZER" --help 2>&1)"
  if grep -q -- '--kernel-name ' <<<"$help"; then
    KERNEL_FILTER=--kernel-name
  elif grep -q -- '--filter ' <<<"$help"; then
    KERNEL_FILTER=--filter
  fi
fi
if [[ $SKIP_SANITIZER -eq 1 ]]; then
  record "sanitizer" "SKIPPED (--skip-sanitizer)" 0 "-"
elif [[ -z "$SANITIZER" ]]; then
  record "sanitizer" "FAIL (compute-sanitizer missing)" 0 "-"
elif [[ $QUICK -eq 1 ]]; then
  RESERVE_S=60
  sanitize memcheck 90 nvfp4 tests/core/test_kernels.py "$MS_EDEN_ORACLE"
else
  # memcheck and racecheck instrument only our kernels (their names hold "nvfp4"); initcheck
  # must see XLA's kernels write the buffers ours read, so it instruments all of them.
  RESERVE_S=135
  sanitize memcheck 60 nvfp4 tests/core/test_kernels.py tests/core/test_quantize.py \
    tests/core/test_ms_eden.py
  RESERVE_S=105
  # MS-EDEN's kernels share the rotation's sign bits through shared memory.
  sanitize racecheck 30 nvfp4 tests/core/test_kernels.py "$MS_EDEN_ORACLE"
  RESERVE_S=60
  sanitize initcheck 45 "" tests/core/test_kernels.py
fi
RESERVE_S=0

# --- 7. benchmarks --------------------------------------------------------------------------

if [[ $QUICK -eq 1 ]]; then
  BENCH_ARGS=(--size 4096 --dense-size 4096 --iters 5 --warmup 2)
else
  BENCH_ARGS=()
fi
run_step "benchmark" 75 "${PREFIX}_bench.log" \
  "$PY" "$BENCH" "${BENCH_ARGS[@]}" --out "${PREFIX}_bench.txt" --json "${PREFIX}_bench.json"

# Optional: one profiled launch of each quantize kernel (needs GPU counter permissions; a
# failure is a warning).
if [[ -n "$NCU" && $QUICK -eq 0 ]]; then
  run_step "ncu (optional)" 30 "${PREFIX}_ncu.log" \
    "$NCU" --kernel-name regex:'Quantize1dKernel|DequantizeKernel|AmaxKernel' --launch-count 4 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis \
    "$PY" "$BENCH" --no-dense --iters 1 --warmup 0
  [[ $STEP_RC -ne 0 ]] && restatus "WARN (ncu exit $STEP_RC)"
fi

if all_passed; then
  summary_and_exit 0 "PASS: every step passed on $GPU_NAME."
fi
summary_and_exit 1 "FAIL: see the failed steps' logs."
