"""Where a GPU step's time goes, for the engine and for the plain PyTorch loop of the same model and batch: the
kernels' device time per step by kernel, the launches (host ops) per step, and the device's busy share of the
step's wall time. It profiles steady steps without synchronising inside them (the engine's own ``--profile``
synchronises every span, so it cannot show run-ahead or launch-bound gaps). Steps are counted by the optimizer's
step (both runs have one AdamW, stepped once per training step). One process under torchrun, from the repository
root on a GPU:

    python -m torch.distributed.run --standalone --nproc_per_node=1 tests/gpu/gpu_step_profile.py OUT.json engine -- \
        --model small --precision bf16 --seq-len 1024 --micro-batch-size 8 --microbatches 2 --steps 30 ...
    python -m torch.distributed.run --standalone --nproc_per_node=1 tests/gpu/gpu_step_profile.py OUT.json plain -- \
        --layers 12 --d-model 768 --heads 12 --seq-len 1024 --vocab-size 50257 ... --steps 30

Profiles steps WAIT+1 .. WAIT+ACTIVE (environment, defaults 10 and 10)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile, schedule

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from the repository root

WAIT, ACTIVE = int(os.environ.get("WAIT", 10)), int(os.environ.get("ACTIVE", 10))
TOP = 25


def run_engine(argv: list[str]) -> None:
    from runtime.commands.train import main  # run.py's training entry point, as torchrun runs it
    main(argv)


def run_plain(argv: list[str]) -> None:
    from runtime.lab.plain_loop import main
    main(argv)


def summarise(prof, wall_s: list[float]) -> dict:
    """Per profiled step: device time by kernel (top TOP), host ops by self time, totals. Kernels are the events
    on the device (host ops carry their kernels' time too, so summing every event would count it twice)."""
    events = prof.key_averages()
    # Ranges the host annotates (ProfilerStep#, the schedule's PP:0F0 ...) have a device copy spanning their
    # kernels: a key seen on the host is not a kernel.
    host_keys = {e.key for e in events if e.device_type == DeviceType.CPU}
    on_device = [e for e in events if e.device_type == DeviceType.CUDA and e.key not in host_keys]
    kernels = sorted(((e.key, e.self_device_time_total / 1e6 / ACTIVE, e.count / ACTIVE) for e in on_device),
                     key=lambda r: -r[1])
    host = sorted(((e.key, e.self_cpu_time_total / 1e6 / ACTIVE, e.count / ACTIVE) for e in events
                   if e.device_type == DeviceType.CPU), key=lambda r: -r[1])
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                        "cuLaunchKernelEx")) / ACTIVE
    busy = sum(seconds for _, seconds, _ in kernels)
    step = sorted(wall_s)[len(wall_s) // 2]
    return {"profiled_steps": ACTIVE, "step_wall_s_median": step, "step_wall_s": wall_s,
            "kernel_seconds_per_step": busy, "device_busy_fraction": busy / step if step else None,
            "kernels_per_step": sum(calls for _, _, calls in kernels), "kernel_launches_per_step": launches,
            "top_kernels": [{"name": n[:160], "seconds": s, "calls": c} for n, s, c in kernels[:TOP]],
            "top_host_ops": [{"name": n[:160], "self_cpu_seconds": s, "calls": c} for n, s, c in host[:TOP]]}


def main() -> None:
    out, kind, argv = sys.argv[1], sys.argv[2], sys.argv[sys.argv.index("--") + 1:]
    steps, wall, last = [0], [], [None]
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                   schedule=schedule(wait=WAIT, warmup=2, active=ACTIVE, repeat=1))

    def after_optimizer_step(optimizer, args, kwargs):  # one call per training step
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        if last[0] is not None and WAIT + 2 <= steps[0] < WAIT + 2 + ACTIVE:
            wall.append(now - last[0])
        last[0] = now
        steps[0] += 1
        prof.step()

    register_optimizer_step_post_hook(after_optimizer_step)
    prof.__enter__()
    (run_engine if kind == "engine" else run_plain)(argv)
    prof.__exit__(None, None, None)
    if int(os.environ.get("RANK", 0)) == 0:
        result = {"kind": kind, "argv": argv,
                  "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
                  **summarise(prof, wall)}
        Path(out).write_text(json.dumps(result, indent=1))
        print(f"{kind}: step {result['step_wall_s_median'] * 1e3:.1f} ms, kernels "
              f"{result['kernel_seconds_per_step'] * 1e3:.1f} ms ({result['device_busy_fraction']:.0%} busy), "
              f"{result['kernel_launches_per_step']:.0f} launches per step")
        for k in result["top_kernels"][:12]:
            print(f"  {k['seconds'] * 1e3:8.2f} ms  {k['calls']:6.0f}x  {k['name'][:100]}")


if __name__ == "__main__":
    main()
