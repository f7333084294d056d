#!/usr/bin/env bash
# DeepSeek-V3-16B-shaped blocks (4, T 4096) and gpt-oss-20b-shaped blocks (4, or 2 where 4 do not fit, T 8192) on one
# lent GPU (H100 or H200) in bf16, a few minutes: each a short run.py training run priced first by run.py plan;
# tokens/s, MFU over the activated parameters, peak memory against the planner's memory model
# (tests/gpu/gpu_families.py). Writes $OUT/{log.txt,families.json,families.txt}. From the repository root:
#   OUT=results bash tests/gpu/gpu_families.sh
# DRY_RUN=1 runs the debug sizes at T 64 for 2 steps on the CPU (tests/gpu/test_gpu_families_scripts.py).
set -uo pipefail
OUT=${OUT:-gpu_families_out}
PY=${PYTHON:-python3}
DRY=${DRY_RUN:+--dry-run}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null
timeout 560 $PY -m tests.gpu.gpu_families "$OUT" $DRY
status=$?
echo "== done in ${SECONDS}s (status $status)"
exit $status
