"""A mixture of experts at ep 1, 2 and 4, its load balance with and without the bias update, and a dense model
with the same activated parameters.

Mixtral's shape (8 experts, top 2, the auxiliary loss) scaled to the CPU: 4 blocks of d 128, 4 heads over 2 key/
value heads, experts of width 128, sequence 128, fp32, on 4 ranks of data parallelism (dp 4). At ep N each group of
N replicas holds 1/N of every layer's experts and exchanges tokens all-to-all (compiler/parallelize/
expert_parallel.py); the experts are FSDP-sharded over the other 4/N replicas. Recorded per ep, alternated over
the repetitions: the expert parameters a rank holds (``local_expert_parameters_max``), the peak tensor memory of
the busiest rank (``--profile-memory``) and tokens/s. The dense model is Llama 3's block with a SwiGLU of width
2 x 128 (what a token's two experts compute). The balance runs train longer from the debug size's wide router
(a skewed start: its initial logits are about 4 apart) with and without ``--expert-bias-rate`` (DeepSeek-V3's
update, here 0.01 so that 100 steps move the biases by up to 1) and log max / mean tokens per expert per layer.
"""

from __future__ import annotations

from statistics import median

from runtime.commands.launch import RunSpec

RANKS = 4
MOE = ["--model", "mixtral-debug", "--layers", "4", "--d-model", "128", "--heads", "4", "--kv-heads", "2",
       "--mlp-width", "128", "--seq-len", "128"]
DENSE = ["--model", "llama3-debug", "--layers", "4", "--d-model", "128", "--heads", "4", "--kv-heads", "2",
         "--mlp-width", "256", "--seq-len", "128", "--untie-embeddings"]
BIAS_RATE = "0.01"
EP_DEGREES = (1, 2, 4)


def expert_specs(rounds: int, *, steps: int, balance_steps: int) -> list[RunSpec]:
    common = ["--dp", str(RANKS), "--pp", "1", "--mp", "1", "--micro-batch-size", "2", "--microbatches", "2",
              "--precision", "fp32", "--data", "builtin", "--eval-every", "0", "--eval-batches", "1", "--seed", "1234"]
    timed = [*common, "--steps", str(steps), "--log-every", str(steps), "--profile-memory"]
    specs = []
    for r in range(rounds):
        order = [(f"ep {ep}", [*MOE, "--ep", str(ep)]) for ep in EP_DEGREES] + [("dense", DENSE)]
        for label, flags in order if r % 2 == 0 else order[::-1]:
            name = f"experts_{label.replace(' ', '')}_r{r}"
            specs.append(RunSpec(name, RANKS, [*flags, *timed], meta={"section": "experts", "label": label, "round": r}))
    for label, extra in (("no bias update", []), (f"bias update {BIAS_RATE}", ["--expert-bias-rate", BIAS_RATE])):
        args = [*MOE, "--ep", "2", *common, "--steps", str(balance_steps), "--log-every", str(max(1, balance_steps // 10)),
                *extra]
        specs.append(RunSpec(f"experts_balance_{'bias' if extra else 'none'}", RANKS, args,
                             meta={"section": "experts", "label": label, "balance": True}))
    return specs


def expert_summary(runs: list[dict]) -> dict:
    """Per ep (and the dense model): expert parameters per rank, peak tensor memory, tokens/s (median over
    repetitions) and the ratios to ep 1; per balance run: max / mean load (averaged over the layers) by step."""
    rows = []
    for label in [f"ep {ep}" for ep in EP_DEGREES] + ["dense"]:
        mine = [r for r in runs if r.get("label") == label and r.get("ok") and not r.get("balance")]
        if not mine:
            continue
        summaries = [r["summary"] for r in mine]
        rows.append({"label": label,
                     "expert_parameters": summaries[0].get("local_expert_parameters_max"),
                     "peak_tensor_bytes": median(s["peak_tensor_bytes"] for s in summaries if s.get("peak_tensor_bytes")),
                     "tokens_per_sec": median(s["tokens_per_sec"] for s in summaries),
                     "step_time_s": median(s["step_time_s"] for s in summaries)})
    base = next((r for r in rows if r["label"] == "ep 1"), None)
    for row in rows:
        if base and row["label"] != "dense" and base["expert_parameters"]:
            row["expert_parameters_vs_ep1"] = row["expert_parameters"] / base["expert_parameters"]
        if base:
            row["step_time_vs_ep1"] = row["step_time_s"] / base["step_time_s"]
    balance = {}
    for r in runs:
        if r.get("balance") and r.get("ok"):
            loads = r["summary"].get("expert_loads", {})
            balance[r["label"]] = {int(step): sum(layers.values()) / len(layers) for step, layers in loads.items()}
    return {"table": rows, "balance": balance}


def experts_markdown(section: dict) -> list[str]:
    def fmt(x, spec=".2f"):
        return "n/a" if x is None else format(x, spec)

    lines = ["## Mixture of experts: expert parallelism, load balance, and a dense model", "", section["method"], "",
             "| run | expert parameters per rank | vs ep 1 | peak tensor MiB | tokens/s | step time vs ep 1 |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in section["summary"]["table"]:
        lines.append(f"| {r['label']} | {fmt(r['expert_parameters'], ',')} | {fmt(r.get('expert_parameters_vs_ep1'), '.3f')} | "
                     f"{fmt(r['peak_tensor_bytes'] / 2**20, '.1f')} | {fmt(r['tokens_per_sec'], ',.0f')} | "
                     f"{fmt(r.get('step_time_vs_ep1'), '.3f')} |")
    lines += ["", "Load balance (max / mean tokens per expert, the mean over the MoE layers, at each logged step):", ""]
    for label, by_step in section["summary"]["balance"].items():
        lines.append(f"- {label}: " + ", ".join(f"step {s} {v:.2f}" for s, v in sorted(by_step.items())))
    return lines + [""]
