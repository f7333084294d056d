#!/usr/bin/env bash
# GPT-2 small on one GPU, engine against the plain PyTorch loop (the README's 0.95x goal): the chunked loss's cost
# at several chunk sizes (tests/gpu/gpu_loss_chunks.py); the two runs alternated twice, unprofiled (their step times);
# then each profiled once by tests/gpu/gpu_step_profile.py (device time by kernel, launches, the device's busy share of
# the step). From the repository root:
#   OUT=results bash tests/gpu/gpu_step_profile.sh      # writes $OUT/{log.txt,loss_chunks.json,profiles.json}
set -uo pipefail
OUT=${OUT:-gpu_step_profile_out}
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>/dev/null
echo "== the loss alone"
timeout 120 $PY -m tests.gpu.gpu_loss_chunks "$OUT/loss_chunks.json"
ENGINE=(--model small --precision bf16 --seq-len 1024 --micro-batch-size 8 --microbatches 2 --eval-every 0
        --data synthetic --log-every 10 --steps 26)
PLAIN=(--layers 12 --d-model 768 --heads 12 --seq-len 1024 --vocab-size 50257 --micro-batch-size 8 --microbatches 2
       --precision bf16 --steps 26)
profiled() {  # NAME engine|plain FLAGS...
    local name=$1 kind=$2; shift 2
    echo "== $name"
    timeout 150 $PY -m torch.distributed.run --standalone --nproc_per_node=1 tests/gpu/gpu_step_profile.py \
        "$WORK/$name.json" "$kind" -- "$@"
}
for i in 1 2; do
    echo "== timed: engine $i"
    timeout 150 $PY -m torch.distributed.run --standalone --nproc_per_node=1 run.py "${ENGINE[@]}" --steps 40 \
        --logdir "$WORK/timed$i" && $PY -c 'import json, sys; s = json.load(open(sys.argv[1]))
print(json.dumps({k: s[k] for k in ("step_time_s", "tokens_per_sec", "peak_bytes")}))' "$WORK/timed$i/summary.json" \
        | tee "$WORK/timed_engine$i.json"
    echo "== timed: plain loop $i"
    timeout 90 $PY -m runtime.lab.plain_loop "${PLAIN[@]}" --steps 40 | tail -1 > "$WORK/timed_plain$i.json"
    cat "$WORK/timed_plain$i.json"
done
profiled engine_profiled engine "${ENGINE[@]}" --logdir "$WORK/profiled"
profiled plain_profiled plain "${PLAIN[@]}"
$PY - "$WORK" "$OUT/profiles.json" <<'PYEOF'
import json, sys
from pathlib import Path
out = {f.stem: json.loads(f.read_text()) for f in sorted(Path(sys.argv[1]).glob("*.json"))}
Path(sys.argv[2]).write_text(json.dumps(out, indent=1))
print(", ".join(f"{k} {v.get('step_wall_s_median', v.get('step_time_s')) * 1e3:.1f} ms" for k, v in out.items()))
PYEOF
echo "== done in ${SECONDS}s"
