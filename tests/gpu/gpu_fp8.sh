#!/usr/bin/env bash
# FP8 and friends on one lent GPU (H100 or H200), one command, about 10 minutes; writes $OUT/results.json:
#   1. Llama-3-8B-shaped blocks (4, T 8192): tokens/s and MFU, bf16 against each --fp8 recipe (gpu_fp8_blocks.py)
#   2. GPT-2 small, the engine against a plain PyTorch loop (gpu_step_profile.sh, its own folder)
#   3. the experts' grouped products against the planner (gpu_moe_experts.py)
#   4. one context-parallel rank's attention at T 131,072 (cp 8) beside the planner's price (gpu_cp_attention.py)
# then gpu_fp8_results.py gathers what each step wrote (a step that failed is named, the others kept). From the
# repository root:
#   OUT=results bash tests/gpu/gpu_fp8.sh
# DRY_RUN=1 runs steps 1, 3 and 4 at tiny sizes on the CPU and skips step 2 (tests/gpu/test_gpu_fp8_scripts.py).
set -uo pipefail
OUT=${OUT:-gpu_fp8_out}
PY=${PYTHON:-python3}
DRY=${DRY_RUN:+--dry-run}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null
echo "== 1. Llama-3-8B blocks, bf16 and FP8"
timeout 240 $PY -m tests.gpu.gpu_fp8_blocks "$OUT/blocks.json" $DRY ${DRY:+--repeats 1}
if [[ -z "$DRY" ]]; then
    echo "== 2. GPT-2 small: engine against a plain loop"
    OUT="$OUT/step_profile" timeout 600 bash tests/gpu/gpu_step_profile.sh
fi
echo "== 3. grouped experts"
if [[ -z "$DRY" ]]; then
    timeout 120 $PY -m tests.gpu.gpu_moe_experts "$OUT/moe_experts.json"
else
    timeout 300 env CUDA_VISIBLE_DEVICES= $PY -m tests.gpu.gpu_moe_experts "$OUT/moe_experts.json"
fi
echo "== 4. context-parallel attention at 128k tokens"
timeout 120 $PY -m tests.gpu.gpu_cp_attention "$OUT/cp_attention.json" $DRY ${DRY:+--repeats 1}
$PY -m tests.gpu.gpu_fp8_results "$OUT"
echo "== done in ${SECONDS}s"
