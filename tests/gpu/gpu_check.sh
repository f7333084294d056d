#!/usr/bin/env bash
# The GPU checks in one call on a lent CUDA machine (issue 27), from the repository root:
#   OUT=results bash tests/gpu/gpu_check.sh
# 1. the README's single-process training, GPT-2 small in bf16 (sequence 1024, 2 micro-batches of 8), alternated
#    with a plain PyTorch loop of the same model and batch (runtime/lab/plain_loop.py);
# 2. the planner's prediction for that run on this machine's preset (no --cluster: the GPU picks it);
# 3. `pytest -m gpu tests`;
# 4. one profiled run (the time split) and, while time is left, the same run with --compile.
# Everything lands in $OUT: log.txt (all output), results.json (summaries with their configs: `run.py calibrate
# --measured $OUT/results.json` refits the GPU preset to them), gpu_tests.xml.
set -uo pipefail
OUT=${OUT:-gpu_check_out}
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-380}  # stop starting optional work past this
WORK=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
$PY -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
torch.cuda.get_device_name(), torch.cuda.get_device_capability(), torch.cuda.device_count())'

SMALL=(--model small --precision bf16 --seq-len 1024 --micro-batch-size 8 --microbatches 2 --eval-every 0)
PLAIN=(--layers 12 --d-model 768 --heads 12 --seq-len 1024 --vocab-size 50257 --micro-batch-size 8
       --microbatches 2 --precision bf16)

engine() {  # NAME FLAGS...: one process under torchrun; its summary.json kept as $WORK/NAME.json
    local name=$1; shift
    echo "== engine $name"
    timeout 150 $PY -m torch.distributed.run --standalone --nproc_per_node=1 run.py "${SMALL[@]}" --logdir "$WORK/$name" "$@" \
        && cp "$WORK/$name/summary.json" "$WORK/$name.json"
}
plain() {
    echo "== plain loop $1"
    timeout 90 $PY -m runtime.lab.plain_loop "${PLAIN[@]}" --steps 60 | tail -1 > "$WORK/$1.json"
    cat "$WORK/$1.json"
}

engine engine1 --steps 60 --log-every 20
plain plain1
engine engine2 --steps 60 --log-every 20
plain plain2

echo "== plan (preset from the GPU's name)"
timeout 60 $PY run.py plan --world 1 --model small --dp 1 --pp 1 --mp 1 --micro-batch-size 8 \
    --global-batch-size 16 --json "$WORK/plan.json"

echo "== pytest -m gpu"
timeout 230 $PY -m pytest -m gpu tests -v -rA -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" \
    -o junit_logging=all --timeout 150

echo "== profiled run"
engine profiled --steps 12 --log-every 4 --profile

if (( SECONDS < BUDGET_S - 120 )); then
    engine compiled --steps 60 --log-every 20 --compile
else
    echo "== skipped the --compile run: ${SECONDS}s of ${BUDGET_S}s used"
fi

$PY - "$WORK" "$OUT/results.json" <<'EOF'
import json, sys
from pathlib import Path
work, out = Path(sys.argv[1]), {}
for f in sorted(work.glob("*.json")):
    try:
        data = json.loads(f.read_text())
    except ValueError as e:
        data = {"unreadable": str(e)}
    if "losses" in data:  # an engine summary: the figures and its config (run.py calibrate --measured reads it)
        data = {k: v for k, v in data.items() if k not in ("grad_norms", "data")}
    out[f.stem] = data
Path(sys.argv[2]).write_text(json.dumps(out, indent=1))
print("results:", ", ".join(out))
EOF
echo "== done in ${SECONDS}s"
