"""``python -m tests.gpu.gpu_families OUT [--dry-run]``: DeepSeek-V3-16B-shaped and gpt-oss-20b-shaped blocks on one
GPU in bf16, each a short ``run.py`` training run (tests/gpu/gpu_families.sh runs it; it has not run on a GPU yet).

Runs, one process each (so one run's memory never reaches the next's):

- DeepSeek-V3-16B (DeepSeek-V2-Lite's shape: multi-head latent attention, 64 routed experts of 1408, top 6, a
  shared one, the first block dense), 4 blocks at T 4096;
- gpt-oss-20b (sinks on every layer, a window of 128 on every other one, 32 experts of 2880, top 4), 4 blocks at
  T 8192.

Each run: ``run.py plan`` prices it first on this machine's cluster (on a CUDA machine its GPU's preset: step time,
MFU, memory per GPU; one rank, micro-batch 1, no activation checkpointing, the chunked loss as training runs it).
A run the planner says does not fit is priced again with fewer blocks (``LAYERS``: 4, then 2: gpt-oss-20b's 4 blocks
at T 8192 need ~102 GiB, more than an H100's 80, less than an H200's 141), and the first that fits trains. Then
``run.py`` trains it for ``STEPS`` steps (``--profile-memory``, synthetic data) and its summary.json is read back:
tokens/s and MFU over the steady steps (the family's FLOPs per token count the activated parameters, 6 N_activated
plus attention: models/deepseek_v3/config.py, models/gpt_oss/config.py), the peak allocated bytes
(``max_memory_allocated``), the second step's peak tensor bytes, and the preflight's prediction of that peak (the
planner's memory model for exactly this run, runtime/commands/preflight.py ``predicted_tensor_bytes``).

Windows and sinks are on only: gpt-oss's attention always has its sinks (models/gpt_oss/model.py builds them on every
layer; no config field removes them), and the sliding layers are a config field (``sliding_layers``) that no
``run.py`` flag sets, so a training run cannot turn either off.

Writes OUT/families.json ({"rows": [...], "dry_run", "device"}) and OUT/families.txt (a short table); a run that
failed keeps its row with ``ok`` false and the tail of its output. ``--dry-run``: the families' debug sizes at T 64
for 2 steps on the CPU (tests/gpu/test_gpu_families_scripts.py), to know the script works before a GPU runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = (4, 2)  # blocks to try, the first the planner says fits
STEPS = 10  # the summary's steady steps are those after the first 3
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Run:
    model: str
    seq_len: int


RUNS = (Run("deepseek-v3-16b", 4096), Run("gpt-oss-20b", 8192))
DRY_RUNS = (Run("deepseek-v3-debug", 64), Run("gpt-oss-debug", 64))


def shape_flags(run: Run, layers: int) -> list[str]:
    """The flags ``run.py`` and ``run.py plan`` share: model, shape, one rank, one sequence of micro-batch 1."""
    return ["--model", run.model, "--layers", str(layers), "--seq-len", str(run.seq_len), "--global-batch-size", "1",
            "--micro-batch-size", "1", "--dp", "1", "--pp", "1", "--mp", "1", "--activation-checkpointing", "none"]


def plan_argv(run: Run, layers: int, json_path: Path, *, cluster: str | None) -> list[str]:
    return ["plan", "--world", "1", *shape_flags(run, layers), "--precisions", "bf16", "--chunked-loss",
            "--json", str(json_path), *(["--cluster", cluster] if cluster else [])]


def train_argv(run: Run, layers: int, logdir: Path, *, steps: int, dry_run: bool) -> list[str]:
    # The dry run's MFU peak is a number, not the CPU calibration's seconds of matrix products.
    return [*shape_flags(run, layers), "--precision", "bf16", "--steps", str(steps), "--data", "synthetic",
            "--eval-every", "0", "--log-every", "1", "--profile-memory", "--logdir", str(logdir),
            *(["--device", "cpu", "--peak-tflops", "1"] if dry_run else [])]


def choose_layers(priced: dict[int, dict | None]) -> int | None:
    """The first block count (in ``LAYERS`` order) whose priced plan fits, else None."""
    return next((layers for layers, plan in priced.items() if plan and plan.get("fits")), None)


def _run_py(argv: list[str], *, timeout: int) -> tuple[bool, str]:
    """``python run.py ARGV`` as a process of its own: (exit status 0, the tail of its output)."""
    try:
        done = subprocess.run([sys.executable, str(ROOT / "run.py"), *argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return False, f"timed out after {timeout} s: {(e.stdout or '')[-1500:]}"
    return done.returncode == 0, (done.stdout + done.stderr)[-1500:]


def price(run: Run, layers: int, work: Path, *, cluster: str | None) -> dict | None:
    """The planner's priced plan of this run (``run.py plan --json``'s "priced"), or None when it failed."""
    path = work / f"plan_{run.model}_{layers}.json"
    ok, tail = _run_py(plan_argv(run, layers, path, cluster=cluster), timeout=180)
    if not ok or not path.exists():
        print(f"plan of {run.model} x{layers} failed: {tail}", flush=True)
        return None
    return json.loads(path.read_text())["priced"]


def row(run: Run, layers: int, plan: dict, summary: dict) -> dict:
    """The measured figures beside the planner's for one training run's summary.json."""
    tensor_peak, predicted = summary.get("peak_tensor_bytes"), summary.get("predicted_peak_tensor_bytes")
    measured_peak = summary.get("peak_bytes")  # max_memory_allocated on a GPU, the process's RSS on the CPU
    planner_tokens_per_sec = run.seq_len / plan["step_time_s"]
    return {"model": run.model, "layers": layers, "seq_len": run.seq_len, "ok": True,
            "tokens_per_sec": summary["tokens_per_sec"], "step_time_s": summary["step_time_s"],
            "mfu_activated": summary["mfu"], "peak_flops_source": summary.get("peak_flops_source"),
            "peak_bytes": measured_peak, "peak_tensor_bytes": tensor_peak, "predicted_peak_tensor_bytes": predicted,
            "peak_tensor_over_predicted": tensor_peak / predicted if tensor_peak and predicted else None,
            "peak_bytes_over_predicted": measured_peak / predicted if measured_peak and predicted else None,
            "planner": {"step_time_s": plan["step_time_s"], "mfu": plan["mfu"], "tokens_per_sec": planner_tokens_per_sec,
                        "memory_gib_per_gpu": plan["memory_gib_per_gpu"], "fits": plan["fits"]},
            "tokens_per_sec_over_planner": summary["tokens_per_sec"] / planner_tokens_per_sec,
            "losses": summary.get("losses")}


def measure(run: Run, work: Path, *, steps: int, dry_run: bool, cluster: str | None) -> dict:
    priced = {}
    for n in LAYERS:  # fewer blocks only when more do not fit
        priced[n] = price(run, n, work, cluster=cluster)
        if choose_layers(priced) is not None:
            break
    layers = choose_layers(priced)
    base = {"model": run.model, "seq_len": run.seq_len, "ok": False,
            "priced_gib_by_layers": {n: p and p["memory_gib_per_gpu"] for n, p in priced.items()}}
    if layers is None:
        return {**base, "error": f"no block count of {list(LAYERS)} fits the planner's memory model (or plan failed)"}
    logdir = work / f"{run.model}_{layers}"
    print(f"== {run.model}, {layers} blocks, T {run.seq_len}", flush=True)
    ok, tail = _run_py(train_argv(run, layers, logdir, steps=steps, dry_run=dry_run), timeout=240)
    print(tail[-600:], flush=True)
    if not ok or not (logdir / "summary.json").exists():
        return {**base, "layers": layers, "error": tail}
    return {**base, **row(run, layers, priced[layers], json.loads((logdir / "summary.json").read_text()))}


def table(rows: list[dict]) -> str:
    def gib(b):
        return f"{b / GIB:.2f}" if b else "-"

    lines = ["model | blocks | T | tokens/s | MFU (activated) | peak alloc GiB | peak tensors GiB | predicted GiB | "
             "tensors/predicted | planner tokens/s",
             "--- | --- | --- | --- | --- | --- | --- | --- | --- | ---"]
    for r in rows:
        if not r["ok"]:
            lines.append(f"{r['model']} | {r.get('layers', '-')} | {r['seq_len']} | failed: "
                         f"{r['error'].strip().splitlines()[-1] if r['error'].strip() else '?'}")
            continue
        ratio = r["peak_tensor_over_predicted"]
        lines.append(f"{r['model']} | {r['layers']} | {r['seq_len']} | {r['tokens_per_sec']:.0f} | "
                     f"{r['mfu_activated']:.1%} | {gib(r['peak_bytes'])} | {gib(r['peak_tensor_bytes'])} | "
                     f"{gib(r['predicted_peak_tensor_bytes'])} | {f'{ratio:.3f}' if ratio else '-'} | "
                     f"{r['planner']['tokens_per_sec']:.0f}")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="folder for families.json and families.txt")
    p.add_argument("--dry-run", action="store_true", help="debug sizes at T 64 for 2 steps on the CPU")
    p.add_argument("--steps", type=int, default=None, help=f"training steps per run (default: {STEPS}; dry run 2)")
    p.add_argument("--cluster", default=None, help="run.py plan's --cluster (default: this machine's; dry run "
                                                   "cpu-2core)")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps {args.steps}: must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    runs = DRY_RUNS if args.dry_run else RUNS
    steps = args.steps or (2 if args.dry_run else STEPS)
    cluster = args.cluster or ("cpu-2core" if args.dry_run else None)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"rows": [], "dry_run": args.dry_run, "steps": steps, "cluster": cluster or "this machine's",
              "windows_and_sinks": "on (run.py cannot turn them off: module docstring)"}
    with tempfile.TemporaryDirectory() as work:
        for run in runs:  # written after each run: a later one killed by the script's timeout leaves the earlier ones
            result["rows"].append(measure(run, Path(work), steps=steps, dry_run=args.dry_run, cluster=cluster))
            (args.out / "families.json").write_text(json.dumps(result, indent=1))
            (args.out / "families.txt").write_text(table(result["rows"]))
    print(table(result["rows"]), flush=True)
    return result


if __name__ == "__main__":
    sys.exit(0 if all(r["ok"] for r in main()["rows"]) else 1)
