#!/usr/bin/env bash
# Long sequences on one lent GPU (issue 36 item 6): a 1B Llama at T 8192 and 32,768, one sequence per step, with and
# without --document-mask; peak memory, tokens/s and the memory model's prediction of each. From the repository root:
#   OUT=results bash tests/gpu/gpu_long_context.sh        # writes $OUT/results.json and $OUT/log.txt
# The documents: token ids drawn at random, lengths log-normal (median e^7 = 1,097 tokens, mean 1,808; web text's
# documents are of this order), each ended by Llama 3's <|end_of_text|> (128001), in a headerless uint32 token
# file. Attention then runs one causal flash call per document (models/common/attention_core.py): ~18 documents per
# sequence at T 32,768. MODEL / SEQ_LENS / STEPS / AC override the defaults (a CPU dry run: MODEL=llama3-debug
# SEQ_LENS="256" STEPS=4 EXTRA="--vocab-size 128256").
set -uo pipefail
OUT=${OUT:-gpu_long_context_out}
PY=${PYTHON:-python3}
MODEL=${MODEL:-llama3-1b}
SEQ_LENS=${SEQ_LENS:-"8192 32768"}
STEPS=${STEPS:-10}
EXTRA=${EXTRA:-}
# --activation-checkpointing for every run: none where the GPU holds a 1B Llama's T 32,768 step (~90 GB: an H200)
GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
AC=${AC:-$( (( ${GPU_MIB:-0} > 100000 )) && echo none || echo selective)}
WORK=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null; echo "activation checkpointing: $AC"

$PY - "$WORK/docs.bin" <<'PYEOF'
import random, sys
from array import array
rng, ids, lengths = random.Random(0), array("I"), []
while len(ids) < 3_000_000:
    n = max(1, int(rng.lognormvariate(7.0, 1.0)))
    lengths.append(n)
    ids.extend(rng.randrange(128000) for _ in range(n - 1))
    ids.append(128001)
open(sys.argv[1], "wb").write(ids.tobytes())  # little-endian on x86-64, as the nanoGPT format stores it
print(f"documents: {len(lengths):,}, {len(ids):,} tokens, median length {sorted(lengths)[len(lengths) // 2]:,}")
PYEOF

COMMON=(--model "$MODEL" --precision bf16 --micro-batch-size 1 --microbatches 1 --steps "$STEPS" --log-every 5
        --eval-every 0 --activation-checkpointing "$AC" --data "$WORK/docs.bin" --data-format nanogpt
        --token-dtype uint32 --eod-token 128001 $EXTRA)
run() {  # NAME FLAGS...
    local name=$1; shift
    echo "== $name: $*"
    timeout 170 $PY -m torch.distributed.run --standalone --nproc_per_node=1 run.py "${COMMON[@]}" "$@" \
        --logdir "$WORK/$name" && cp "$WORK/$name/summary.json" "$WORK/$name.json"
    # with EXTRA=--profile: the time split and the timeline (gzipped) come back too
    [[ -f "$WORK/$name/time_split.json" ]] && cp "$WORK/$name/time_split.json" "$OUT/$name.time_split.json" \
        && gzip -c "$WORK/$name/timeline.json" > "$OUT/$name.timeline.json.gz"
}
for t in $SEQ_LENS; do
    run "t${t}_no_mask" --seq-len "$t"
    run "t${t}_document_mask" --seq-len "$t" --document-mask
done

$PY - "$WORK" "$OUT/results.json" <<'PYEOF'
import json, sys
from pathlib import Path
keep = ("config", "device", "step_time_s", "step_times", "tokens_per_sec", "mfu", "peak_bytes", "peak_reserved_bytes_per_rank",
        "predicted_peak_tensor_bytes", "final_loss")
out = {f.stem: {k: v for k, v in json.loads(f.read_text()).items() if k in keep}
       for f in sorted(Path(sys.argv[1]).glob("t*.json"))}
Path(sys.argv[2]).write_text(json.dumps(out, indent=1))
gib = 2**30
for name, r in out.items():
    predicted = r.get("predicted_peak_tensor_bytes")
    print(f"{name}: {r['tokens_per_sec']:,.0f} tokens/s, step {r['step_time_s']:.3f} s, MFU {r['mfu']:.1%}, "
          f"peak {(r['peak_bytes'] or 0) / gib:.2f} GiB (reserved {max(x or 0 for x in r['peak_reserved_bytes_per_rank'] or [0]) / gib:.2f})"
          + (f", memory model {predicted / gib:.2f} GiB" if predicted else ""))
PYEOF
echo "== done in ${SECONDS}s"
