"""``python run.py calibrate``: measure this machine and write a cluster file for the planner.

What it measures, with one process per compute unit running at the same time (as training does):
- for each precision, forward + backward of a transformer block at a small and a large shape; a
  straight-line fit of time against counted FLOPs gives the achievable FLOP/s and the fixed cost
  per layer (Python, kernel launches), which dominates small models on CPU;
- the best dense matmul rate per precision (the peak MFU is measured against);
- causal attention (``scaled_dot_product_attention``) forward + backward at three sequence lengths and two head
  dims, fp32 and bf16: the CPU's flash kernel runs at its own rate, far from the block rate at short T;
- a mixture-of-experts block (Mixtral's) at the same two shapes as the dense block: its own rate and fixed cost;
- tensor parallelism's DTensor cost per module: the small block under the engine's TP plan on a mesh of one
  process against the plain block (dispatch and placement conversions; the collectives are priced apart);
- gloo all-reduce between two processes at several sizes: latency and bandwidth from a fit of the
  ring formula, time = S / bandwidth + 2 * latency for two ranks;
- AdamW's throughput over parameter bytes.

Then (runtime/calibrate_engine.py) a few short engine runs on ``--engine-world`` ranks fit the
factors that turn those isolated prices into engine step times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from compiler.parallelize.tensor_parallel import apply_tp
from compiler.planner.block_benchmark import MOE_BLOCK, SHAPES, block_seconds, forward_backward_seconds
from compiler.planner.cluster import CALIBRATED, Cluster, EngineFactors, load_cluster, preset_for_device
from compiler.planner.collectives import Link, Topology
from compiler.planner.cpu_identity import cpu_identity
from compiler.planner.devices import CpuDevice
from compiler.planner.measured import fit_to_runs, read_runs
from compiler.planner.shape import DENSE, DecoderShape, tensor_parallel_modules
from compiler.precisions import PRECISIONS
from models import named_config, spec_of
from runtime.device import device_description, has_accelerator
from runtime.distributed.spawn import SpawnError, spawn_ranks
from runtime.engine.optim import build_optimizer
from runtime.lab.calibrate_engine import calibrate_engine, calibration_runs, refit_engine
from runtime.observe.peak_flops import best_matmul_flops


def own_process_mesh() -> DeviceMesh:
    """A mesh of this process alone, made on every process at once (every rank creates every group, as
    new_group needs): DTensor's dispatch runs on it, no collective has a peer to wait for."""
    rank, world = dist.get_rank(), dist.get_world_size()
    return DeviceMesh.from_group([dist.new_group([r]) for r in range(world)][rank], "cpu")


def tp_module_seconds(mesh: DeviceMesh, precision: str, rounds: int = 5) -> float:
    """DTensor's cost per tensor-parallel module and micro-batch (forward + backward), collectives apart: a
    block at the overhead-bound shape timed plain and under the engine's tensor-parallel plan on ``mesh``, a
    mesh of this one process (DTensor's dispatch and placement conversions run, no collective does), the
    difference over the plan's module count. The two alternate, so that drift hits both."""
    batch, seq, d, heads = SHAPES[0]
    cfg = named_config("tiny", n_layers=1, d_model=d, n_heads=heads, seq_len=seq, vocab_size=256)
    spec = spec_of(cfg)
    plain, sharded = spec.build(cfg), spec.build(cfg)
    apply_tp(sharded, mesh, block_plan=spec.block_plan(sequence_parallel=False))
    modules = tensor_parallel_modules(DecoderShape.from_config(cfg), DENSE, sequence_parallel=False)
    x = torch.randn(batch, seq, d, requires_grad=True)
    differences = []
    for _ in range(rounds):
        base = statistics.median(forward_backward_seconds(plain.layers["0"], x, precision, 3))
        differences.append(statistics.median(forward_backward_seconds(sharded.layers["0"], x, precision, 3)) - base)
    return max(0.0, statistics.median(differences) / modules)


# Causal attention's rate grows with the sequence and the head dim (the CPU flash kernel's tiles): measured at
# these (T, head_dim), with fewer heads at long T so that each takes about a second. fp16 runs ~35x slower than
# bf16 on CPUs without AVX-512 FP16 and is left at the block rate.
ATTENTION_POINTS = ((512, 32, 8), (512, 128, 8), (2048, 32, 8), (2048, 128, 8), (8192, 32, 1), (8192, 128, 1))
ATTENTION_PRECISIONS = ("fp32", "bf16")


def attention_rate(seq: int, head_dim: int, heads: int, precision: str, repeats: int = 2) -> float:
    """FLOP/s of one causal ``scaled_dot_product_attention`` forward + backward, batch 1, over the FLOPs it runs:
    forward 2 T^2 hd per head (QK^T and AV over the causal half), backward 2.5x that."""
    dtype = PRECISIONS[precision].dtype
    q, k, v = (torch.randn(1, heads, seq, head_dim, dtype=dtype, requires_grad=True) for _ in range(3))
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        if i:
            times.append(time.perf_counter() - start)
    return 3.5 * 2 * seq * seq * head_dim * heads / statistics.median(times)


def straight_line(points: list[tuple[float, float]]) -> dict:
    """Rate (FLOP/s) and fixed seconds of time = overhead + FLOPs / rate through two (seconds, FLOPs) points."""
    (t0, f0), (t1, f1) = points
    rate = (f1 - f0) / max(t1 - t0, 1e-9)
    return {"rate": rate, "overhead": max(0.0, t0 - f0 / rate), "points": points}


def _compute_worker(out_dir: str) -> None:
    """One of the concurrent measuring processes (runtime/distributed/spawn.py sets RANK, WORLD_SIZE)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result: dict = {"block": {}, "matmul": {}}
    for precision in PRECISIONS:
        dist.barrier()  # every process measures at the same time, like concurrent ranks
        result["block"][precision] = straight_line([block_seconds(*shape, precision) for shape in SHAPES])
        result.setdefault("moe_block", {})[precision] = straight_line(
            [block_seconds(*shape, precision, **MOE_BLOCK) for shape in SHAPES])
        result["matmul"][precision] = best_matmul_flops(PRECISIONS[precision].dtype, torch.device("cpu"))
    own = own_process_mesh()
    result["tp_module"] = {}
    for precision in PRECISIONS:
        dist.barrier()
        result["tp_module"][precision] = tp_module_seconds(own, precision)
    result["attention"] = {}
    for precision in ATTENTION_PRECISIONS:
        dist.barrier()
        result["attention"][precision] = [(t, hd, attention_rate(t, hd, heads, precision))
                                          for t, hd, heads in ATTENTION_POINTS]
    if world >= 2:
        result["all_reduce"] = _all_reduce_fit()
    if rank == 0:
        result["adamw_bytes_per_s"] = _adamw_rate()
    with open(f"{out_dir}/calib{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _all_reduce_fit() -> dict:
    sizes = [2**10, 2**16, 2**20, 2**22]
    times = []
    for n in sizes:
        t = torch.zeros(n // 4)
        for _ in range(3):
            dist.all_reduce(t)
        samples = []
        for _ in range(5):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(10):  # back to back: amortises the barrier's exit skew between ranks
                dist.all_reduce(t)
            samples.append((time.perf_counter() - start) / 10)
        times.append(statistics.median(samples))
    # Least squares of time = a + b * bytes; for two ranks the ring gives a = 2 * latency, b = 1 / bandwidth.
    mean_s, mean_t = statistics.mean(sizes), statistics.mean(times)
    b = sum((s - mean_s) * (t - mean_t) for s, t in zip(sizes, times)) / sum((s - mean_s) ** 2 for s in sizes)
    a = mean_t - b * mean_s
    return {"latency": max(a / 2, 1e-6), "bandwidth": 1 / max(b, 1e-12), "sizes": sizes, "times": times}


def _adamw_rate() -> float:
    params = [torch.nn.Parameter(torch.randn(1024, 1024)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = build_optimizer(params, lr=1e-3, weight_decay=0.1)  # the engine's AdamW kernels
    opt.step()
    start = time.perf_counter()
    for _ in range(5):
        opt.step()
    return 5 * sum(p.numel() * 4 for p in params) / (time.perf_counter() - start)


def measure(processes: int, work_dir: Path, *, timeout: float = 900) -> list[dict]:
    """Run the measurements on ``processes`` concurrent single-thread processes."""
    try:
        spawn_ranks(_compute_worker, world_size=processes, args=(str(work_dir),), timeout=timeout)
    except SpawnError as e:
        raise RuntimeError(f"calibration processes failed or timed out: {e}") from None
    return [json.loads((work_dir / f"calib{r}.json").read_text()) for r in range(processes)]


def mean_attention_points(results: list[dict]) -> dict[str, tuple[tuple[float, float, float], ...]]:
    """Each (T, head_dim) point's rate averaged over the concurrent processes."""
    first = results[0].get("attention", {})
    return {p: tuple((t, hd, statistics.mean(r["attention"][p][i][2] for r in results))
                     for i, (t, hd, _) in enumerate(points)) for p, points in first.items()}


def mean_tp_module_overhead(results: list[dict]) -> dict[str, float] | None:
    """Each precision's DTensor cost per tensor-parallel module, averaged over the concurrent processes."""
    if "tp_module" not in results[0]:
        return None
    return {p: statistics.mean(r["tp_module"][p] for r in results) for p in results[0]["tp_module"]}


def build_cluster(results: list[dict], *, name: str, cores: int, ranks_per_node: int, memory_bytes: float) -> Cluster:
    def mean(key: str, precision: str, block: str = "block") -> float:
        return statistics.mean(r[block][precision][key] for r in results)

    moe = "moe_block" in results[0]

    all_reduce = results[0].get("all_reduce") or {"latency": 50e-6, "bandwidth": 1e9}
    link = Link(bandwidth=all_reduce["bandwidth"], latency=all_reduce["latency"])
    device = CpuDevice(flops={p: mean("rate", p) for p in PRECISIONS},
                       peak_flops={p: statistics.mean(r["matmul"][p] for r in results) for p in PRECISIONS},
                       units_per_node=cores, memory_per_node=memory_bytes, layer_overhead=mean("overhead", "fp32"),
                       optimizer_bytes_per_s=results[0]["adamw_bytes_per_s"],
                       attention_points=mean_attention_points(results),
                       moe_flops={p: mean("rate", p, "moe_block") for p in PRECISIONS} if moe else None,
                       moe_layer_overhead={p: mean("overhead", p, "moe_block") for p in PRECISIONS} if moe else None,
                       tp_module_overhead=mean_tp_module_overhead(results))
    return Cluster(
        name=name, device=device, topology=Topology(ranks_per_node, link, link), factors=EngineFactors(),
        source=f"python run.py calibrate on {time.strftime('%Y-%m-%d')}: {processes_note(len(results))}",
        notes={"all_reduce_fit": all_reduce,
               "block_points": {p: results[0]["block"][p]["points"] for p in PRECISIONS},
               "flops_meaning": "achieved FLOP/s of one unit on transformer-block forward+backward (fitted); "
                                "peak_flops: best dense matmul (F.linear) rate, used for MFU",
               "memory": "80% of physical RAM, shared by the node's ranks",
               "cpu_identity": cpu_identity()},
    )


def print_cluster(cluster: Cluster) -> None:
    d, link, f = cluster.device, cluster.topology.intra, cluster.factors
    if not cluster.is_gpu:
        for precision in PRECISIONS:
            print(f"  {precision}: {d.flops[precision] / 1e9:.1f} GFLOP/s per core on blocks, "
                  f"peak matmul {d.peak_flops[precision] / 1e9:.1f}")
            points = (d.attention_points or {}).get(precision)
            if points:
                print("    causal attention: " + ", ".join(f"T {t:,.0f} hd {hd:.0f} {r / 1e9:.1f}" for t, hd, r in points))
        if d.moe_flops:
            print("  mixture-of-experts blocks: " + ", ".join(
                f"{p} {r / 1e9:.1f} GFLOP/s + {(d.moe_layer_overhead or {}).get(p, 0.0) * 1e3:.2f} ms per layer"
                for p, r in d.moe_flops.items()))
        if d.tp_module_overhead:
            print("  tensor parallelism (DTensor) per module of a block: " + ", ".join(
                f"{p} {s * 1e3:.2f} ms" for p, s in d.tp_module_overhead.items()))
        print(f"  fixed cost per layer {d.layer_overhead * 1e3:.2f} ms; all-reduce latency "
              f"{link.latency * 1e6:.0f} us, bandwidth {link.bandwidth / 1e9:.2f} GB/s; "
              f"AdamW {d.optimizer_bytes_per_s / 1e9:.2f} GB/s")
    tables = sorted(cluster.factors_by_world.items()) or [(None, f)]
    for world, f in tables:
        print(f"  engine factors{f' at {world} ranks' if world else ''}: compute x{f.compute_scale:.2f}, "
              f"TP/CP/EP/PP communication x{f.comm_scale:.2f}, DP x{f.dp_comm_scale:.2f}, "
              f"{f.action_overhead * 1e3:.2f} ms per pipeline action, {f.step_overhead * 1e3:.1f} ms per step")


def calibrate_measured(args: argparse.Namespace) -> int:
    """``--measured FILE``: fit a cluster's engine factors to measured runs of any device (measured_runs.py)."""
    try:
        runs = read_runs(args.measured)
        base = args.base or preset_for_device(runs[0].device)
        if base is None:
            raise ValueError(f"no preset matches the runs' device ({runs[0].device}); pass --base FILE.json")
        cluster = fit_to_runs(load_cluster(base), runs)
    except (ValueError, OSError) as e:
        print(f"error: --measured: {e}")
        return 2
    out = Path(args.out if args.out != str(CALIBRATED) or not cluster.is_gpu else f"{Path(base).stem}-fitted.json")
    out.write_text(cluster.to_json())
    for row in cluster.notes["engine_fit"]["runs"]:
        print(f"  {row['run']}: {row['plan']}: measured {row['measured_s']:.4f} s/step, fit error "
              f"{100 * row['fit_error']:+.1f}%")
    print_cluster(cluster)
    print(f"wrote {out}")
    return 0


def processes_note(n: int) -> str:
    return f"{n} concurrent single-thread processes, gloo all-reduce between them"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="run.py calibrate", description="Measure this machine (block FLOP/s per "
                                "precision, fixed per-layer cost, gloo all-reduce latency and bandwidth, AdamW rate) "
                                "and write a cluster file for `run.py plan` and --auto.")
    p.add_argument("--out", default=str(CALIBRATED), help="cluster JSON to write")
    p.add_argument("--ranks-per-node", type=int, default=8, help="ranks you launch per node (CPU: may exceed cores)")
    p.add_argument("--engine-world", type=int, default=4,
                   help="ranks of the engine runs that fit the time model's engine factors (2 or a multiple of 4; "
                        "0 skips them, ~6 min at 4 ranks on 2 cores); with --base fitted at another world, both "
                        "fits are kept and each plan is priced with the factors of the world nearer its own")
    p.add_argument("--base", default=None, help="skip the kernel measurements: start from this cluster file or "
                   "preset and only rerun the engine runs that fit its engine factors")
    p.add_argument("--refit", action="store_true", help="with --base: no new runs; refit the engine factors to the "
                   "engine runs recorded in that file (after a change of the time model)")
    p.add_argument("--measured", metavar="FILE", help="any device: no new runs; fit --base's engine factors (default: "
                   "the preset of the runs' GPU) to measured engine runs (a summary.json, or tests/gpu/gpu_check.sh's "
                   "results.json) and write the cluster to --out")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.measured:
        return calibrate_measured(args)
    if has_accelerator():
        print("error: calibrate measures CPU machines; on a GPU run tests/gpu/gpu_check.sh and pass its results with "
              "--measured (or start from a preset in compiler/clusters/)")
        return 2
    if args.refit and not args.base:
        print("error: --refit needs --base (the cluster file whose recorded engine runs to refit)")
        return 2
    if args.engine_world:
        try:
            calibration_runs(args.engine_world)
        except ValueError as e:
            print(f"error: {e}")
            return 2
    if args.base:
        try:
            cluster = load_cluster(args.base)
        except ValueError as e:
            print(f"error: {e}".replace("--cluster", "--base"))
            return 2
    else:
        cores = os.cpu_count() or 1
        print(f"calibrating {device_description(torch.device('cpu'))} with {cores} concurrent processes ...", flush=True)
        with tempfile.TemporaryDirectory() as work:
            results = measure(cores, Path(work))
        memory = 0.8 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        cluster = build_cluster(results, name=f"calibrated: {device_description(torch.device('cpu'))}", cores=cores,
                                ranks_per_node=args.ranks_per_node, memory_bytes=memory)
    if args.refit:
        try:
            cluster = refit_engine(cluster, cluster)
        except ValueError as e:
            print(f"error: --refit: {e}")
            return 2
    elif args.engine_world:
        print(f"fitting the engine factors from short training runs on {args.engine_world} ranks ...", flush=True)
        cluster = calibrate_engine(cluster, world=args.engine_world)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(cluster.to_json())
    print_cluster(cluster)
    print(f"wrote {out}")
    return 0
