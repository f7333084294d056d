"""Long sequences: the document mask's cost, and context parallelism at cp 1, 2, 4 and 8 on 8 ranks.

A 4-block Llama 3 shape (d 256, 8 heads over 4 key/value heads, the byte vocabulary), fp32, one sequence per
micro-batch, the built-in text. The mask rows train one process at T 4096 with and without ``--document-mask``
(packed documents attended one causal run each, no (T, T) mask; models/common/attention_core.py) and record the
peak tensor memory (``--profile-memory``) and step time. The cp rows train 8 ranks, dp 8 / cp, at one T, each
with the memory model's prediction beside the measured peak. The longest T the memory model lets each cp train
within 20 GiB of machine memory (the preflight's own sum over the node's ranks, runtime/commands/preflight.py)
is computed without checkpointing and with selective checkpointing (which gathers K and V again in the backward
instead of keeping them in every layer), and the selective one checked by a run where the machine allows: one
cp group (cp ranks, dp 1) trains one step at that T, capped (a step's attention grows as T squared: on 2 cores
a step at T 32,768 takes minutes), with ``--compact-cpu-memory`` (resident memory follows live tensors: what the
preflight prices), and its busiest rank's process peak times 8 is the 8-rank node's memory (an upper bound: at
dp 8 / cp FSDP shards the weights over 8 ranks, not cp).
"""

from __future__ import annotations

from statistics import median

from runtime.commands.launch import RunSpec

SIZE = ["--layers", "4", "--d-model", "256", "--heads", "8", "--kv-heads", "4"]
SHAPE = ["--model", "llama3-debug", *SIZE]
# gpt-oss at the same size (issue 55): its preset keeps head_dim 16 (a setting of its own, models/gpt_oss/config.py),
# the sinks, the window of 8 on layers 0 and 2 and the 4 experts of width 32, top 2, in every block.
GPT_OSS_SHAPE = ["--model", "gpt-oss-debug", *SIZE]
MODEL_SHAPES = {"llama3-debug": SHAPE, "gpt-oss-debug": GPT_OSS_SHAPE}
COMMON = ["--precision", "fp32", "--data", "builtin", "--micro-batch-size", "1", "--microbatches", "1",
          "--eval-every", "0", "--eval-batches", "1", "--profile-memory", "--seed", "1234"]
MASK_T = 4096
CP_DEGREES = (1, 2, 4, 8)
RANKS = 8
BUDGET_GIB = 20.0
SELECTIVE = ["--activation-checkpointing", "selective"]


def long_context_specs(*, cp_seq_len: int, steps: int, longest_cap: int = 0) -> list[RunSpec]:
    specs = []
    for label, extra in (("no mask", []), ("document mask", ["--document-mask", "--eod-token", "10"])):
        args = [*SHAPE, *COMMON, "--seq-len", str(MASK_T), "--steps", str(steps), "--log-every", str(steps), *extra]
        specs.append(RunSpec(f"long_context_mask_{'on' if extra else 'off'}", 1, args,
                             meta={"section": "long_context", "label": label, "kind": "mask"}))
    for cp in CP_DEGREES:
        args = [*SHAPE, *COMMON, "--seq-len", str(cp_seq_len), "--steps", str(steps), "--log-every", str(steps),
                "--dp", str(RANKS // cp), "--cp", str(cp)]
        specs.append(RunSpec(f"long_context_cp{cp}", RANKS, args,
                             meta={"section": "long_context", "label": f"cp {cp}", "kind": "cp", "cp": cp}))
    for cp in CP_DEGREES if longest_cap else ():
        seq_len = min(longest_sequence(cp, SELECTIVE), longest_cap // (2 * cp * 1024) * 2 * cp * 1024)
        specs.append(check_spec(f"long_context_longest_cp{cp}", cp=cp, seq_len=seq_len))
    return specs


def check_spec(name: str, *, cp: int, seq_len: int, shape: list[str] = SHAPE, flags: list[str] = SELECTIVE) -> RunSpec:
    """One cp group (cp ranks, dp 1) training one step of ``shape`` at ``seq_len`` with ``flags``, resident memory
    following live tensors: a check of the memory model's limit (8 x its busiest rank's process peak is the node)."""
    args = [*shape, *COMMON, "--seq-len", str(seq_len), "--steps", "1", "--log-every", "1", "--dp", "1",
            "--cp", str(cp), *flags, "--compact-cpu-memory"]
    return RunSpec(name, cp, args, meta={"section": "long_context", "label": f"cp {cp} at T {seq_len}",
                                         "kind": "longest", "cp": cp, "seq_len": seq_len})


def longest_sequence(cp: int, flags: list[str] = (), *, shape: list[str] = SHAPE, budget_gib: float = BUDGET_GIB,
                     ranks: int = RANKS) -> int:
    """The longest T (a multiple of 2 cp x 1024) the memory model predicts 8 ranks at dp 8 / cp train ``shape`` (its
    model flags) within the budget with ``flags`` added, by doubling and bisection."""
    from runtime.commands.flags import parse_train_config
    from runtime.commands.preflight import NodeMemory, predicted_bytes

    step = 2 * cp * 1024
    memory = NodeMemory(budget_gib * 2**30 / 0.9)  # the preflight keeps 10% of RAM free

    def fits(seq_len: int) -> bool:
        cfg = parse_train_config([*shape, *COMMON, "--seq-len", str(seq_len), "--dp", str(ranks // cp), "--cp", str(cp),
                                  *flags], world_size=ranks)
        return predicted_bytes(cfg, node_ranks=list(range(ranks)), memory=memory) <= 0.9 * memory.total

    lo, hi = 0, step
    while fits(hi) and hi < 2**22:
        lo, hi = hi, hi * 2
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def long_context_summary(runs: list[dict]) -> dict:
    def row(r):
        s = r["summary"]
        return {"label": r["label"], "ok": r["ok"], "peak_tensor_bytes": s.get("peak_tensor_bytes"),
                "predicted_peak_tensor_bytes": s.get("predicted_peak_tensor_bytes"),
                "step_time_s": median(s["step_times"][1:] or s["step_times"]) if s.get("step_times") else None,
                "tokens_per_sec": s.get("tokens_per_sec")}
    mask = [row(r) for r in runs if r.get("kind") == "mask"]
    cp = [{**row(r), "cp": r["cp"], "longest_seq_len_predicted": longest_sequence(r["cp"]),
           "longest_seq_len_predicted_selective": longest_sequence(r["cp"], SELECTIVE)}
          for r in runs if r.get("kind") == "cp"]
    checked = [{**row(r), "cp": r["cp"], "seq_len": r["seq_len"], "process_peak_bytes": r["summary"].get("peak_bytes"),
                "node_bytes": RANKS * r["summary"]["peak_bytes"] if r["summary"].get("peak_bytes") else None}
               for r in runs if r.get("kind") == "longest"]
    return {"mask": mask, "cp": cp, "checked": checked}


def long_context_markdown(section: dict) -> list[str]:
    def mib(x):
        return "n/a" if not x else f"{x / 2**20:.1f}"

    lines = ["## Long sequences: the document mask and context parallelism", "", section["method"], "",
             "| run | peak tensor MiB | step time s | tokens/s |", "| --- | --- | --- | --- |"]
    for r in section["summary"]["mask"]:
        lines.append(f"| {r['label']} | {mib(r['peak_tensor_bytes'])} | {r['step_time_s'] or 0:.2f} | "
                     f"{r['tokens_per_sec'] or 0:.0f} |")
    lines += ["", "| cp | peak tensor MiB (busiest rank) | predicted MiB | tokens/s | longest T predicted within "
              f"{BUDGET_GIB:.0f} GiB | the same, selective checkpointing |", "| --- | --- | --- | --- | --- | --- |"]
    for r in section["summary"]["cp"]:
        lines.append(f"| {r['cp']} | {mib(r['peak_tensor_bytes'])} | {mib(r['predicted_peak_tensor_bytes'])} | "
                     f"{r['tokens_per_sec'] or 0:.0f} | {r['longest_seq_len_predicted']:,} | "
                     f"{r['longest_seq_len_predicted_selective']:,} |")
    if section["summary"].get("checked"):
        lines += ["", f"The longest T checked by a run (selective checkpointing; one cp group, dp 1, one step; node = "
                      f"{RANKS} x the busiest rank's process peak):", "",
                  "| cp | T | peak tensor MiB (busiest rank) | predicted MiB | process peak MiB | node GiB | "
                  f"within {BUDGET_GIB:.0f} GiB | step s |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in section["summary"]["checked"]:
            node = r["node_bytes"]
            fits = "n/a" if node is None else "yes" if node <= BUDGET_GIB * 2**30 else "no"
            lines.append(f"| {r['cp']} | {r['seq_len']:,} | {mib(r['peak_tensor_bytes'])} | "
                         f"{mib(r['predicted_peak_tensor_bytes'])} | {mib(r['process_peak_bytes'])} | "
                         f"{'n/a' if node is None else f'{node / 2**30:.2f}'} | {fits if r['ok'] else 'failed'} | "
                         f"{r['step_time_s'] or 0:.1f} |")
    return lines + [""]
