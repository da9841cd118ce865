#!/usr/bin/env bash
# The GPU checks, in one command: the CUDA tests, the parity suite with xenc_lab on the GPU, and the benchmark on
# the GPU. Each step's output and report go to OUT (default reports/cuda); the exit status is non-zero if any failed.
# Usage: scripts/gpu_checks.sh [OUT]   (PYTHON=... picks the interpreter; default: python)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-reports/cuda}
py=${PYTHON:-python}
mkdir -p "$out"
if ! "$py" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  echo "scripts/gpu_checks.sh: torch sees no CUDA GPU here; the GPU checks need one" >&2
  exit 2
fi
"$py" - >"$out/environment.txt" <<'PY'
import torch
props = torch.cuda.get_device_properties(0)
print(f"{props.name}, {props.total_memory / 2**30:.0f} GiB, compute capability {props.major}.{props.minor}")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}")
PY
failed=()
# 1. the tests that run on CUDA (they skip elsewhere), and the CUDA glue's CPU stand-ins
"$py" -m pytest tests -k "cuda or varlen" -p no:cacheprovider -rs 2>&1 | tee "$out/tests.log" || failed+=(tests)
# 2. the parity suite with xenc_lab on the GPU in fp32 (its compiled properties skip there), the oracle on the CPU;
#    run whole, it writes reports/parity-cuda.md (a partial run writes no report)
XENC_LAB_PARITY_DEVICE=cuda "$py" -m pytest parity_tests -p no:cacheprovider -rs 2>&1 \
  | tee "$out/parity.log" || failed+=(parity)
[[ -f reports/parity-cuda.md && "$out" != reports ]] && cp reports/parity-cuda.md "$out/parity.md"
# 3. both engines on the GPU, fp16 and bf16, compiled too, with peak memory
"$py" -m xenc_lab.cli bench --device cuda --compile --memory --report "$out" 2>&1 | tee "$out/bench.log" \
  || failed+=(bench)
if ((${#failed[@]})); then
  echo "scripts/gpu_checks.sh: failed: ${failed[*]} (logs in $out)" >&2
  exit 1
fi
echo "scripts/gpu_checks.sh: all GPU checks passed (reports in $out)"
