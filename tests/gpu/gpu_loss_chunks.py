"""The chunked loss's cost on one GPU: forward + backward time and peak memory of
``compiler.parallelize.cross_entropy.chunked_cross_entropy`` at several chunk sizes against
``F.cross_entropy`` on fp32 logits (the plain loop's loss), on bf16 logits of GPT-2's (8192 x 50,257: one
micro-batch of 8 x 1024) and Llama 3's vocabulary (8192 x 128,256). Run from the repository root on a GPU:
``python -m tests.gpu.gpu_loss_chunks OUT.json`` (on a CPU: a dry run at small sizes)."""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from compiler.parallelize.cross_entropy import chunk_rows, chunked_cross_entropy
from tests.gpu.gpu_timing import median_ms

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = ((8192, 50257), (8192, 128256)) if DEVICE == "cuda" else ((256, 1000),)
CHUNK_MIB = (64, 256, 1024, 4096)
REPEATS = 10


def timed(loss_of, logits: torch.Tensor, targets: torch.Tensor) -> dict:
    """Median forward + backward milliseconds over REPEATS (after two warm-ups) and the peak bytes above the inputs."""
    def once():
        x = logits.detach().requires_grad_()
        loss_of(x, targets).backward()
        return x.grad
    for _ in range(2):
        once()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    ms = median_ms(once, repeats=REPEATS, warmups=0)
    peak = torch.cuda.max_memory_allocated() - base if DEVICE == "cuda" else None
    return {"ms": ms, "peak_bytes_above_inputs": peak}


def main(out: str) -> None:
    results = []
    for n, v in SHAPES:
        logits = torch.randn(n, v, device=DEVICE, dtype=torch.bfloat16)
        targets = torch.randint(0, v, (n,), device=DEVICE)
        cases = {"F.cross_entropy(fp32 logits)": lambda x, t: F.cross_entropy(x.float(), t)}
        for mib in CHUNK_MIB:
            rows = chunk_rows(v, chunk_bytes=mib * 2**20)
            cases[f"chunked {mib} MiB ({rows} rows)"] = (lambda r: lambda x, t: chunked_cross_entropy(
                x, t, rows_per_chunk=r))(rows)
        for name, fn in cases.items():
            r = {"rows": n, "vocab": v, "case": name, **timed(fn, logits, targets)}
            results.append(r)
            peak = r["peak_bytes_above_inputs"]
            print(f"{n} x {v}: {name}: {r['ms']:.2f} ms" + (f", peak +{peak / 2**30:.2f} GiB" if peak else ""))
        del logits, targets
    with open(out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
                   "results": results}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
