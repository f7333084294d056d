#!/usr/bin/env bash
# Engine runs on one lent GPU for the planner (issue 38): step times and peak memory of a few models and plans,
# each summary kept with its config, so that `run.py calibrate --measured` can refit the GPU preset's engine
# factors and `run.py validate --measured` can compare predictions with them. From the repository root:
#   OUT=results bash tests/gpu/gpu_planner_runs.sh        # 195 s on an H100 (2026-11-26); writes $OUT/results.json
# then: python run.py calibrate --measured results/results.json --out my-gpu.json
# RUNS="gpt2-small gpt2-small-v50304" runs only those (results.json is rewritten after every run). The -v50304 runs
# pad GPT-2's 50,257-word vocabulary to a multiple of 64: the head's products then run on aligned kernels.
set -uo pipefail
OUT=${OUT:-gpu_planner_out}
PY=${PYTHON:-python3}
STEPS=${STEPS:-16}
WORK=$(mktemp -d)
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv
COMMON=(--precision bf16 --data synthetic --eval-every 0 --eval-batches 1 --steps "$STEPS" --log-every 8 --microbatches 2)
collect() {  # every summary so far into $OUT/results.json
$PY - "$WORK" "$OUT/results.json" <<'PYEOF'
import json, sys
from pathlib import Path
keep = ("config", "device", "step_time_s", "step_times", "tokens_per_sec", "mfu", "peak_bytes", "peak_bytes_per_rank",
        "peak_reserved_bytes_per_rank", "predicted_peak_tensor_bytes", "world_size")
out = {f.stem: {k: v for k, v in json.loads(f.read_text()).items() if k in keep} for f in sorted(Path(sys.argv[1]).glob("*.json"))}
Path(sys.argv[2]).write_text(json.dumps(out, indent=1))
print("results:", ", ".join(f"{k} {v['step_time_s']:.4f} s" for k, v in out.items()))
PYEOF
}
run() {  # NAME FLAGS...
    local name=$1; shift
    [[ -n "${RUNS:-}" && " $RUNS " != *" $name "* ]] && return
    echo "== $name: $*"
    timeout 150 $PY -m torch.distributed.run --standalone --nproc_per_node=1 run.py "${COMMON[@]}" "$@" \
        --logdir "$WORK/$name" && cp "$WORK/$name/summary.json" "$WORK/$name.json" && collect
}
run gpt2-small --model small --seq-len 1024 --micro-batch-size 8
run gpt2-small-v50304 --model small --vocab-size 50304 --seq-len 1024 --micro-batch-size 8
run llama-1b --model llama3-1b --seq-len 2048 --micro-batch-size 4
run llama-1b-ac --model llama3-1b --seq-len 2048 --micro-batch-size 8 --activation-checkpointing
run llama-3b-ac --model llama3-3b --seq-len 2048 --micro-batch-size 2 --activation-checkpointing
run gpt2-medium --model medium --seq-len 1024 --micro-batch-size 8
run gpt2-medium-v50304 --model medium --vocab-size 50304 --seq-len 1024 --micro-batch-size 8
echo "== done in ${SECONDS}s"
