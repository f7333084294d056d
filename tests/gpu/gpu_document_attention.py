"""Packed documents' attention on one GPU (issue 36 item 6): forward + backward time of a 1B Llama's attention core
(32 query heads, 8 key/value heads, head dim 64, bf16, one sequence) at T 8192 and 32,768, documents of log-normal
lengths (tests/gpu/gpu_long_context.sh's), for: one causal call over the whole sequence (no mask), the engine's
``CausalAttention`` (one causal call per document), and torch's variable-length flash call
(``torch.nn.attention.varlen.varlen_attn``) where this torch has it; then the profiler's top kernels of the
engine's path. Run from the repository root on a GPU: ``python -m tests.gpu.gpu_document_attention OUT.json``."""

from __future__ import annotations

import inspect
import json
import random
import sys
import time

import torch
import torch.nn.functional as F

from models.common.attention_core import CausalAttention, document_runs

H, HKV, HD = 32, 8, 64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a dry run of this script
SEQ_LENS = (8192, 32768) if DEVICE == "cuda" else (512, 1024)


def documents_of(seq_len: int, seed: int = 0) -> torch.Tensor:
    """(1, T) document ids of a window cut from documents of log-normal length (median 1,097 tokens)."""
    rng, ids, doc = random.Random(seed), [], 0
    while len(ids) < seq_len:
        ids += [doc] * max(1, int(rng.lognormvariate(7.0, 1.0)))
        doc += 1
    return torch.tensor(ids[:seq_len]).view(1, -1)


def varlen_call():
    """(q, k, v, documents) -> (1, H, T, hd) through varlen_attn, or None where this torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    causal = ({"is_causal": True} if "is_causal" in inspect.signature(varlen_attn).parameters
              else {"window_size": (-1, 0)})

    def call(q, k, v, documents):
        edges = [lo for lo, _ in document_runs(documents[0])] + [documents.shape[1]]
        cu = torch.tensor(edges, dtype=torch.int32, device=q.device)
        longest = max(b - a for a, b in zip(edges[:-1], edges[1:]))
        flat = [t.transpose(1, 2).reshape(-1, t.shape[1], HD) for t in (q, k, v)]  # (T, heads, hd)
        out = varlen_attn(*flat, cu, cu, longest, longest, enable_gqa=True, **causal)
        return out.view(1, -1, H, HD).transpose(1, 2)
    return call


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn, q, k, v, documents, repeats: int = 10) -> float:
    """Median seconds of forward + backward."""
    times = []
    for i in range(repeats + 3):
        sync()
        start = time.perf_counter()
        fn(q, k, v, documents).sum().backward()
        sync()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main(out_path: str) -> None:
    results = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"}
    core, varlen = CausalAttention(), varlen_call()
    variants = {"no mask": lambda q, k, v, d: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                "per document (engine)": lambda q, k, v, d: core(q, k, v, d)}
    if varlen:
        variants["varlen_attn"] = varlen
    for seq_len in SEQ_LENS:
        documents = documents_of(seq_len).to(DEVICE)
        q, k, v = (torch.randn(1, seq_len, n, HD, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2)
                   .requires_grad_() for n in (H, HKV, HKV))
        row = {"documents": len(document_runs(documents[0]))}
        for name, fn in variants.items():
            try:
                row[name] = timed(fn, q, k, v, documents)
            except Exception as e:  # noqa: BLE001 - recorded, the next variant still runs
                row[name] = f"{type(e).__name__}: {e}"[:300]
        if varlen and isinstance(row["varlen_attn"], float):
            want = variants["per document (engine)"](q, k, v, documents).float()
            row["varlen max abs diff"] = (varlen(q, k, v, documents).float() - want).abs().max().item()
        results[f"T {seq_len}"] = row
        print(seq_len, row, flush=True)
        if seq_len == SEQ_LENS[0]:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                core(q, k, v, documents).sum().backward()
                sync()
            table = prof.key_averages().table(sort_by="cuda_time_total" if DEVICE == "cuda" else "cpu_time_total", row_limit=12)
            results[f"profile T {seq_len} per document"] = table
            print(table, flush=True)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
