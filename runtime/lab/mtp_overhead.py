"""Multi-token prediction's step-time overhead, side by side in one process: ``python -m runtime.lab.mtp_overhead``.

Two engines on one rank, built by the engine's own builder (runtime/engine/build.py) from the same flags, seed and
data, one of them with ``--mtp-depth 1``, train alternately step by step (the order reversed every other pair), so
whatever else loads the machine loads both alike; the overhead is the median over the pairs of (the step with the
depth) / (the step without), beside the planner's price of the same two runs on this machine's calibration.
Default model: DeepSeek-V3's debug shape widened for the CPU (4 blocks of d 128, 4 heads, T 128: one dense and three
mixture-of-experts blocks, latent attention with a q LoRA rank, YaRN), whose depth is a mixture-of-experts block;
fp32, 2 micro-batches of 4 sequences, synthetic tokens, one thread. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile

import torch

from compiler.planner.cluster import load_cluster
from compiler.planner.search import price
from compiler.planner.shape import DecoderShape
from runtime.checkpoint.weights import initial_values
from runtime.commands.flags import parse_train_config
from runtime.device import configure_cpu_threads
from runtime.distributed.process_group import LaunchEnv, collective_timeout, init_distributed, shutdown_distributed
from runtime.engine.build import build_engine, build_step_context
from runtime.engine.data import build_data_from_config
from runtime.engine.loop import Batches
from runtime.engine.step import timed, train_step

MODEL = ["--model", "deepseek-v3-debug", "--layers", "4", "--d-model", "128", "--heads", "4", "--seq-len", "128"]
RUN = ["--precision", "fp32", "--micro-batch-size", "4", "--microbatches", "2", "--data", "synthetic", "--eval-every",
       "0", "--eval-batches", "1", "--skip-memory-check"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime.lab.mtp_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=20, help="timed pairs of steps (after --warmup pairs)")
    p.add_argument("--warmup", type=int, default=2, help="pairs not timed (the first steps allocate and trace)")
    p.add_argument("--model-flags", default=" ".join(MODEL), help="the model's run.py flags")
    return p


def _engine(flags: list[str], env: LaunchEnv, device: torch.device, logdir: str):
    """A training step context and this rank's batches of the run ``flags`` describe."""
    cfg = parse_train_config([*flags, "--logdir", logdir], world_size=1)
    data = build_data_from_config(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.model.seq_len,
                                  global_batch_size=cfg.global_batch_size, seed=cfg.seed)
    engine = build_engine(cfg, env=env, device=device, timeout=collective_timeout(cfg.startup_timeout_s),
                          initial_value=initial_values(None, cfg.model, seed=cfg.seed), announce=False)
    ctx, _ = build_step_context(engine)
    return cfg, ctx, Batches(data, cfg.data, engine.replica_rows(), device, None, cfg.model.mtp_depth)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    env, device = LaunchEnv(rank=0, world_size=1, local_rank=0, local_world_size=1), torch.device("cpu")
    configure_cpu_threads(1)
    init_distributed(env, device)
    steps = args.warmup + args.pairs
    runs = {}
    with tempfile.TemporaryDirectory() as logdir:
        for depth in (0, 1):
            flags = [*args.model_flags.split(), *RUN, "--steps", str(steps), "--mtp-depth", str(depth)]
            runs[depth] = _engine(flags, env, device, f"{logdir}/depth{depth}")
        seconds: dict[int, list[float]] = {0: [], 1: []}
        for step in range(steps):
            for depth in (0, 1) if step % 2 == 0 else (1, 0):
                _, ctx, batches = runs[depth]
                inputs, targets = batches.of(batches.data.train, step)
                _, took = timed(lambda: train_step(ctx, inputs, targets), device)  # noqa: B023 (called at once)
                if step >= args.warmup:
                    seconds[depth].append(took)
    shutdown_distributed()
    ratios = [with_depth / without for without, with_depth in zip(seconds[0], seconds[1])]
    cluster, plans = load_cluster("cpu-2core"), {}
    for depth, (cfg, _, _) in runs.items():
        plans[depth] = price(DecoderShape.from_config(cfg.model), cfg.plan, cluster=cluster).step_time
    print(json.dumps({"model": args.model_flags, "pairs": args.pairs, "overhead": statistics.median(ratios),
                      "overhead_quartiles": statistics.quantiles(ratios, n=4),
                      "step_s": {str(d): statistics.median(s) for d, s in seconds.items()},
                      "planner_overhead": plans[1] / plans[0]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
