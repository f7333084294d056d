"""Memory of starting from a Hugging Face folder: a script for a quiet machine, not a CI test.

    python -m tests.hf_memory large [--dir DIR] [--steps 2] [--baseline]   # GPT-2 Large on 2x2x2 (~10 min, 3.1 GB)
    python -m tests.hf_memory small [--mesh 1,2,2] [--source hf|seeded]    # 4 ranks, ~100M parameters (~1 min)

``large`` writes a GPT-2 Large folder of random fp32 weights (``model-0000N-of-0000M.safetensors``, 1 GB shards,
written one shard at a time) and trains from it with the README's 19.1 GiB command line, sampling
/proc/meminfo every 0.2 s: the goal is that the machine's used memory stays within 20 GiB. ``--baseline``
runs the same command without --init-from first, for a same-day comparison. Used memory is reported two
ways: MemTotal - MemAvailable, and free(1)'s "used" (MemTotal - MemFree - Buffers - Cached - SReclaimable);
the folder's pages in the page cache are reclaimable and count in neither.

``small`` measures the loading itself, per rank: the stages are built from a folder (or name-seeded) on
``--mesh`` and each rank reports its resident anonymous memory's growth while materialising (sampled
between parameters and every millisecond by a thread) against the bytes of the shards it keeps and the
largest full tensor of its stages. Loading from a folder should cost a rank its shards plus at most one
full tensor at a time, as the name-seeded start does.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from runtime.checkpoint.hf_folder import CONFIG_FILE, SAFETENSORS_METADATA
from runtime.checkpoint.safetensors import INDEX_FILE, plan_shards, save_file, shard_name, write_json
from tests.hf_folders import gpt2_config, gpt2_tensors
from tests.paths import ROOT

LARGE_FLAGS = ["--dp", "2", "--pp", "2", "--mp", "2", "--model", "large", "--seq-len", "256", "--precision", "bf16",
               "--micro-batch-size", "1", "--microbatches", "4", "--reshard-after-forward", "--activation-checkpointing",
               "--compact-cpu-memory", "--eval-every", "0", "--log-every", "1", "--peak-tflops", "1"]
GIB = 2**30
BUILD_OVERHEAD_MIB = 64


def write_random_gpt2_folder(path: Path, config: dict, *, max_shard_bytes: int = 10**9) -> int:
    """A GPT-2 folder of N(0, 0.02^2) weights (biases 0, norms 1), written a shard at a time so the writer
    holds one shard; returns the bytes of tensors."""
    shapes = gpt2_tensors(config)
    sizes = {name: 4 * torch.Size(shape).numel() for name, shape in shapes.items()}
    groups = plan_shards(sizes, max_shard_bytes)
    path.mkdir(parents=True)
    weight_map = {}
    for i, names in enumerate(groups):
        file = shard_name(i + 1, len(groups))
        g = torch.Generator().manual_seed(i)
        tensors = {name: (torch.ones(shapes[name]) if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight"))
                          else torch.zeros(shapes[name]) if name.endswith("bias")
                          else torch.randn(shapes[name], generator=g).mul_(0.02)) for name in names}
        save_file(tensors, path / file, metadata=SAFETENSORS_METADATA)
        weight_map.update(dict.fromkeys(names, file))
        del tensors
    write_json(path / INDEX_FILE, {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map})
    write_json(path / CONFIG_FILE, config)
    return sum(sizes.values())


def meminfo() -> dict[str, int]:
    with open("/proc/meminfo") as f:
        return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}


def used_bytes() -> tuple[int, int]:
    """(MemTotal - MemAvailable, free(1)'s used)."""
    m = meminfo()
    return (m["MemTotal"] - m["MemAvailable"],
            m["MemTotal"] - m["MemFree"] - m["Buffers"] - m["Cached"] - m.get("SReclaimable", 0))


def run_sampled(cmd: list[str], *, log: Path, timeout: float) -> dict:
    """Run ``cmd``, sampling the machine's used memory every 0.2 s; returns the peaks and the exit code."""
    baseline = used_bytes()
    peak, peak_free, peak_at = baseline[0], baseline[1], 0.0
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        while proc.poll() is None and time.monotonic() - start < timeout:
            used, used_free = used_bytes()
            if used > peak:
                peak, peak_at = used, time.monotonic() - start
            peak_free = max(peak_free, used_free)
            time.sleep(0.2)
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    return {"returncode": proc.wait(), "seconds": round(time.monotonic() - start, 1),
            "baseline_used_gib": round(baseline[0] / GIB, 2), "peak_used_gib": round(peak / GIB, 2),
            "peak_at_s": round(peak_at, 1), "peak_free_style_used_gib": round(peak_free / GIB, 2),
            "baseline_free_style_used_gib": round(baseline[1] / GIB, 2), "log": str(log)}


def large(args: argparse.Namespace) -> dict:
    root = Path(args.dir or tempfile.mkdtemp(prefix="hf-large-"))
    folder = root / "gpt2-large"
    config = gpt2_config(n_layer=args.layers, n_embd=1280, n_head=20, n_positions=1024, vocab_size=50257)
    if folder.exists() and json.loads((folder / CONFIG_FILE).read_text())["n_layer"] != args.layers:
        raise SystemExit(f"{folder} holds another number of layers; give another --dir")
    if not folder.exists():
        started = time.monotonic()
        total = write_random_gpt2_folder(folder, config)
        print(f"wrote {folder}: {total / 1e9:.2f} GB in {time.monotonic() - started:.0f} s", flush=True)
    report = {"folder": str(folder), "limit_gib": 20}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=8", str(ROOT / "run.py")]
    runs = (["baseline"] if args.baseline else []) + ["from_folder"]
    for run in runs:
        flags = [*LARGE_FLAGS, "--steps", str(args.steps), "--logdir", str(root / f"log-{run}")]
        if args.layers != 36 or args.seq_len != 256:  # a smoke run of the script on a smaller machine
            flags += ["--layers", str(args.layers), "--seq-len", str(args.seq_len)]
        flags += ["--init-from", str(folder)] if run == "from_folder" else []
        report[run] = run_sampled([*torchrun, *flags], log=root / f"{run}.log", timeout=args.timeout)
        print(json.dumps({run: report[run]}), flush=True)
    result = report["from_folder"]
    report["within_limit"] = result["returncode"] == 0 and result["peak_used_gib"] <= report["limit_gib"]
    return report


# ---- small: per-rank memory while materialising the stages ----

def _status() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[-1] == "kB"}


def _measure_rank(folder: str, mesh_shape: tuple[int, int, int], source: str, out_dir: str) -> None:
    import torch.distributed as dist

    from compiler.parallelize.data_parallel import DataParallelOptions
    from compiler.parallelize.stages import StageMeshes, build_local_stages
    from compiler.partition import uniform_split
    from compiler.schedules import SCHEDULES
    from models import spec_of
    from runtime.checkpoint.hf_weights import check_weights, initial_values, read_hf_model
    from runtime.distributed.mesh import GridLayout, build_mesh, fsdp_mesh
    from runtime.distributed.process_group import collective_timeout

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    hf = read_hf_model(folder)
    cfg = hf.config
    layout = GridLayout(*mesh_shape)
    timeout = collective_timeout(600)
    mesh = build_mesh("cpu", layout, timeout=timeout)
    _, pp_rank, _ = layout.coordinates(dist.get_rank())
    source_fn = (initial_values(check_weights(hf)) if source == "hf"
                 else functools.partial(spec_of(cfg).initial_value, seed=0, cfg=cfg))
    peak = {"anon": 0}
    largest = {"bytes": 0, "read": 0}

    def sample():
        peak["anon"] = max(peak["anon"], _status()["RssAnon"])

    def measured(name, shape):
        value = source_fn(name, shape)
        sample()  # the full value exists now, beside the shards so far
        largest["bytes"] = max(largest["bytes"], 4 * value.numel())
        largest["read"] += value.numel() * value.element_size()
        return value

    stop = threading.Event()

    def sampler():
        while not stop.is_set():
            sample()
            time.sleep(0.001)

    thread = threading.Thread(target=sampler, daemon=True)
    before = _status()
    thread.start()
    stages = build_local_stages(
        cfg, blocks_per_stage=uniform_split(cfg.n_layers, layout.pp),
        stage_indices=SCHEDULES["1f1b"].stage_indices(pp_rank, pp=layout.pp, stages_per_rank=1), micro_batch_size=1,
        meshes=StageMeshes(pp=mesh["pp"], mp=mesh["mp"], fsdp=fsdp_mesh(mesh, layout, timeout=timeout)),
        device=torch.device("cpu"),
        activation_checkpointing="none", data_parallel=DataParallelOptions(), initial_value=measured)
    stop.set()
    thread.join()
    after = _status()
    held = sum(p.to_local().numel() * 4 if hasattr(p, "to_local") else p.numel() * 4 for p in stages.parameters())
    result = {"rank": dist.get_rank(), "held_mib": held / 2**20, "largest_full_tensor_mib": largest["bytes"] / 2**20,
              "tensor_bytes_read_mib": largest["read"] / 2**20,
              "anon_growth_peak_mib": (peak["anon"] - before["RssAnon"]) / 2**20,
              "anon_growth_end_mib": (after["RssAnon"] - before["RssAnon"]) / 2**20,
              "hwm_growth_mib": (after["VmHWM"] - before["VmRSS"]) / 2**20}
    result["beyond_shards_mib"] = result["anon_growth_peak_mib"] - result["held_mib"]
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def small(args: argparse.Namespace) -> dict:
    from tests.launch import spawn_ranks

    root = Path(args.dir or tempfile.mkdtemp(prefix="hf-small-"))
    folder = root / "gpt2-100m"
    config = gpt2_config(n_layer=12, n_embd=768, n_head=12, n_positions=256, vocab_size=32768)
    if not folder.exists():
        write_random_gpt2_folder(folder, config, max_shard_bytes=200 * 10**6)
    mesh = tuple(int(x) for x in args.mesh.split(","))
    out = root / f"ranks-{args.source}-{'x'.join(map(str, mesh))}"
    out.mkdir(exist_ok=True)
    spawn_ranks(_measure_rank, world_size=mesh[0] * mesh[1] * mesh[2], args=(str(folder), mesh, args.source, str(out)),
                timeout=args.timeout)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(mesh[0] * mesh[1] * mesh[2])]
    model_mib = sum(4 * torch.Size(s).numel() for s in gpt2_tensors(config).values()) / 2**20
    # Beyond its shards a rank keeps what building the stages allocates anyway (the traced graphs, DTensor and
    # FSDP state: 40-50 MiB at the end of a name-seeded start of this model) and, while loading, one full tensor.
    within = all(r["beyond_shards_mib"] <= r["largest_full_tensor_mib"] + BUILD_OVERHEAD_MIB for r in ranks)
    return {"folder": str(folder), "model_mib": round(model_mib, 1), "mesh": args.mesh, "source": args.source,
            "ranks": [{k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()} for r in ranks],
            "each_rank_within_shards_plus_one_tensor": within}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.hf_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("size", choices=("large", "small"))
    p.add_argument("--dir", help="where the folder (reused if present) and logs go (default: a new temporary folder)")
    p.add_argument("--steps", type=int, default=2, help="large: training steps")
    p.add_argument("--baseline", action="store_true", help="large: first run the same flags without --init-from")
    p.add_argument("--layers", type=int, default=36, help="large: blocks (36 is GPT-2 Large; fewer for a smoke run)")
    p.add_argument("--seq-len", type=int, default=256, help="large: training sequence (256 as the README's run)")
    p.add_argument("--mesh", default="1,2,2", help="small: dp,pp,mp of the 4 ranks")
    p.add_argument("--source", choices=("hf", "seeded"), default="hf", help="small: the folder, or name-seeded values")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    args = p.parse_args(argv)
    report = large(args) if args.size == "large" else small(args)
    print(json.dumps(report, indent=2))
    ok = report["within_limit"] if args.size == "large" else report["each_rank_within_shards_plus_one_tensor"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
