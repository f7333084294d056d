"""The reference points for engine overhead: a plain PyTorch training loop, on one process or, under
torchrun, with ``DistributedDataParallel`` (``no_sync`` for every micro-batch but the last, as a DDP user
accumulates gradients).

No tracing, no schedule, no engine code on the compute path: the same GPT, the same AdamW and clipping,
the same micro-batch gradient accumulation and synthetic tokens as the engine's runs (each DDP rank
takes its rows of the global batch). Rank 0 prints one JSON line with its median step time and
throughput, measured the way the engine measures them.

    python -m runtime.lab.plain_loop --layers 16 --d-model 384 --heads 8 --seq-len 128 \
        --micro-batch-size 4 --microbatches 8 --steps 6 --precision fp32
    torchrun --nproc_per_node=2 -m runtime.lab.plain_loop --layers 8 --d-model 256 ...   # DDP
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from compiler.precisions import PRECISIONS
from models import build_model, named_config
from runtime.device import (
    configure_cpu_threads,
    configure_fp32_matmuls,
    peak_memory_bytes,
    retain_cpu_heap,
    select_device,
    synchronize,
)
from runtime.distributed.process_group import LaunchEnv, init_distributed, shutdown_distributed
from runtime.engine.amp import autocast
from runtime.engine.data import SyntheticBatches, inputs_and_targets, replica_rows
from runtime.engine.optim import build_lr_schedule, build_optimizer
from runtime.observe.metrics import Throughput

# The model's config fields and their flags: a GPT-2 of the tiny size's rules (MLP width, tied embeddings) with
# this shape, what the study's engine runs build from the same config (runtime/commands/flags.py model_flags).
SHAPE_FLAGS = {"n_layers": "--layers", "d_model": "--d-model", "n_heads": "--heads", "seq_len": "--seq-len",
               "vocab_size": "--vocab-size"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("layers", 16), ("d-model", 384), ("heads", 8), ("seq-len", 128), ("vocab-size", 256),
                          ("micro-batch-size", 4), ("microbatches", 8), ("steps", 6), ("seed", 1234)):
        p.add_argument(f"--{flag}", type=int, default=default)
    p.add_argument("--precision", choices=tuple(PRECISIONS), default="fp32")
    p.add_argument("--lr", type=float, default=1e-3)
    return p


def model_config(args: argparse.Namespace):
    """The model the loop trains: the tiny GPT-2 size with the shape flags' values."""
    return named_config("tiny", n_layers=args.layers, d_model=args.d_model, n_heads=args.heads, seq_len=args.seq_len,
                        vocab_size=args.vocab_size)


def plain_flags(cfg) -> list[str]:
    """The flags that make this loop train ``cfg``; ValueError for a model it cannot build (another family, or a
    field its flags do not set, such as the MLP width or untied embeddings, away from the tiny size's rules)."""
    flags = [text for field, flag in SHAPE_FLAGS.items() for text in (flag, str(getattr(cfg, field)))]
    if model_config(build_parser().parse_args(flags)) != cfg:
        raise ValueError(f"the plain loop builds GPT-2 by the tiny size's rules from {', '.join(SHAPE_FLAGS.values())} "
                         f"only; it cannot train {cfg}")
    return flags


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)

    env = LaunchEnv.from_environ()
    device = select_device(env.local_rank, local_world_size=env.local_world_size)
    configure_fp32_matmuls(device, args.precision)  # as the engine's fp32 (TF32 on CUDA)
    if device.type == "cpu":
        configure_cpu_threads(env.local_world_size)
        retain_cpu_heap()  # the engine's process settings (threads, allocator): only the code paths differ
    distributed = env.world_size > 1
    if distributed:
        init_distributed(env, device)
    cfg = model_config(args)
    model = build_model(cfg, seed=args.seed, device=device)
    optimizer = build_optimizer(list(model.parameters()), lr=args.lr, weight_decay=0.1)
    if distributed:
        model = DistributedDataParallel(model)
    schedule = build_lr_schedule(optimizer, warmup_steps=1, total_steps=args.steps)
    scaler = torch.amp.GradScaler(device.type, enabled=PRECISIONS[args.precision].loss_scaling)
    batch = args.micro_batch_size * args.microbatches * env.world_size  # the global batch; each rank its rows
    data = SyntheticBatches(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, global_batch_size=batch, seed=args.seed)
    throughput = Throughput(batch, cfg.seq_len, 0.0, 1.0)
    rows = replica_rows(batch, env.rank, env.world_size)
    for step in range(args.steps):
        inputs, targets = (t.to(device) for t in inputs_and_targets(data.rows(step, *rows)))
        synchronize(device)
        start = time.perf_counter()
        for i, (mb_inputs, mb_targets) in enumerate(zip(inputs.chunk(args.microbatches),
                                                        targets.chunk(args.microbatches))):
            # DDP all-reduces gradients during the last micro-batch's backward only.
            last = i == args.microbatches - 1
            with autocast(device.type, args.precision), (contextlib.nullcontext() if last or not distributed
                                                          else model.no_sync()):
                logits = model(mb_inputs)
                loss = F.cross_entropy(logits.float().flatten(0, 1), mb_targets.flatten()) / args.microbatches
                scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        synchronize(device)
        throughput.step_times.append(time.perf_counter() - start)
    steady = throughput.steady_step_time()
    result = {"step_times": throughput.step_times, "step_time_s": steady, "samples_per_sec": throughput.samples_per_sec(steady),
              "tokens_per_sec": throughput.tokens_per_sec(steady), "peak_bytes": peak_memory_bytes(device),
              "precision": args.precision, "dtype": str(PRECISIONS[args.precision].dtype)}
    if env.rank == 0:
        print(json.dumps(result), flush=True)
    if distributed:
        shutdown_distributed()
        # End here, with the DDP model still referenced: freeing its Reducer destroys the last reference to
        # its gloo process group, whose destructor joins gloo's worker thread while holding the GIL, and a
        # worker still releasing its last all-reduce needs the GIL: a deadlock (seen once in CI).
        sys.stderr.flush()
        os._exit(0)
    return result


if __name__ == "__main__":
    main()
