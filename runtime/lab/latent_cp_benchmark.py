"""Context parallelism of one latent attention layer, gathering its latent against gathering its keys and values:
``python -m runtime.lab.latent_cp_benchmark``.

``--cp`` gloo ranks (default 2, one thread each) hold the load-balanced chunks of every sequence and run the same
``LatentAttention`` (models/common/latent_attention.py) forward and backward both ways, alternately (the order
reversed every other pair, so whatever else loads the machine loads both alike): with ``GatheredLatent`` (the latent
and RoPE key all-gathered, kv_b over the whole sequence) and with the keys and values all-gathered (the fallback).
Reports the median milliseconds of each, their ratio, and the values and bytes each gathers per layer per micro-batch
(compiler/context_gather.py, the engine's rule). Default shape: DeepSeek-V3's attention with 16 of its 128 heads
(d 1024, qk 128 + 64, v 128, r 512, q rank 384, YaRN), T 2048, fp32. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from compiler.context_gather import context_gather_of
from models import build_model, named_config
from runtime.distributed.spawn import spawn_ranks


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime.lab.latent_cp_benchmark", description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=16, help="attention heads (DeepSeek-V3: 128)")
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=2048, help="the whole sequence; each rank holds 1/cp of it")
    p.add_argument("--cp", type=int, default=2, help="context-parallel ranks (the sequence must split into 2 x cp chunks)")
    p.add_argument("--pairs", type=int, default=6, help="timed pairs of steps (after one warm-up pair)")
    return p


def _config(heads: int, d_model: int, seq_len: int):
    """DeepSeek-V3's attention sizes with ``heads`` heads, in a one-block dense model (the layer is all that runs)."""
    return dataclasses.replace(named_config("deepseek-v3"), n_layers=1, first_k_dense=1, n_heads=heads,
                               d_model=d_model, seq_len=seq_len, q_lora_rank=384, vocab_size=256, mlp_width=256)


def _steps(heads: int, d_model: int, seq_len: int, pairs: int, out_file: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from compiler.parallelize.context_parallel import ContextParallelAttention, local_chunks
    from compiler.parallelize.latent_gather import GatheredLatent

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, cp = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    base = build_model(_config(heads, d_model, seq_len), seed=0).layers["0"].attn  # LatentAttention
    paths = {}
    for name, latent in (("latent", True), ("kv", False)):
        attn = copy.deepcopy(base)
        if latent:
            attn.kv_latent = GatheredLatent(mesh)
        attn.core = ContextParallelAttention(mesh, whole_keys=latent)
        paths[name] = attn
    x = local_chunks(torch.randn(1, seq_len, d_model), rank=rank, cp=cp).requires_grad_()
    positions = local_chunks(torch.arange(seq_len).unsqueeze(0), rank=rank, cp=cp)

    def step(name: str) -> float:
        dist.barrier()
        start = time.perf_counter()
        paths[name](x, positions).sum().backward()
        dist.barrier()
        return time.perf_counter() - start

    seconds = {"latent": [], "kv": []}
    for pair in range(pairs + 1):
        order = ("latent", "kv") if pair % 2 == 0 else ("kv", "latent")
        for name in order:
            took = step(name)
            if pair:  # the first pair warms up
                seconds[name].append(took)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(seconds, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cp < 2 or args.seq_len % (2 * args.cp):
        parser.error(f"--cp {args.cp} --seq-len {args.seq_len}: cp must be at least 2 and the sequence a multiple of "
                     "2 x cp (each rank holds two load-balanced chunks)")
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        spawn_ranks(_steps, world_size=args.cp, args=(args.heads, args.d_model, args.seq_len, args.pairs, out.name),
                    timeout=1800)
        seconds = json.loads(Path(out.name).read_text())
    gather = context_gather_of(_config(args.heads, args.d_model, args.seq_len), mp=1)
    latent_ms, kv_ms = (1e3 * statistics.median(seconds[k]) for k in ("latent", "kv"))
    print(json.dumps({
        "heads": args.heads, "d_model": args.d_model, "seq_len": args.seq_len, "cp": args.cp, "pairs": args.pairs,
        "latent_ms": round(latent_ms, 1), "kv_ms": round(kv_ms, 1), "kv_over_latent": round(kv_ms / latent_ms, 3),
        "latent_values_per_token": gather.values_per_token, "kv_values_per_token": gather.kv_values_per_token,
        "latent_bytes_per_layer": gather.gathered_bytes(micro_batch_size=1, seq_len=args.seq_len, itemsize=4),
        "kv_bytes_per_layer": args.seq_len * gather.kv_values_per_token * 4}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
