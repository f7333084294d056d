"""``python run.py sft-benchmark --tokenizer FOLDER``: supervised fine-tuning throughput with and without packing.

    python run.py sft-benchmark --tokenizer tests/fixtures/tokenizers/chat/qwen2-style --out sft_benchmark

Writes ``--conversations`` seeded conversations of mixed length (1 to 3 exchanges; answer lengths log-uniform
from 1 to ``--longest`` words, so most are short and a few fill a window), then trains the same model on them
in one process, packed (the default) and one conversation per window (``--no-packing``), alternating
``--repeats`` times. Each run reports, per second of its fastest step after the first (best of N, as ``timeit``
reports: on a shared machine other jobs only ever slow a step down), window tokens (padding included) and, from the
windows its steps read, conversation tokens (what the model learns from: padding excluded) and trained (assistant)
tokens; results.json keeps every run and its median step too, the printed table the medians over the runs.

Timings depend on the machine's load: run it on a quiet machine for numbers to report.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

from runtime.commands.launch import RunSpec, execute
from runtime.engine.data import build_data
from runtime.engine.data.chat_corpus import PackingOptions
from runtime.tokenizer import load_tokenizer

WORDS = ("the of and to in is was for on that with as by at from his an were are which this be or has had not but "
         "one their all its new after two first other also more who into time only year can over some most").split()
SEED = 1234  # training's default --seed: the benchmark reads the windows the runs read


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="run.py sft-benchmark", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="a tokenizer folder with a chat template")
    p.add_argument("--out", default="sft_benchmark", help="folder for chat.jsonl, the runs' logs and results.json")
    p.add_argument("--conversations", type=int, default=600)
    p.add_argument("--longest", type=int, default=200, help="the longest answer, in words")
    p.add_argument("--model", default="tiny")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3, help="runs of each kind, alternated")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in conversations(args.conversations, longest=args.longest)))
    vocab = load_tokenizer(args.tokenizer).vocab_size
    common = ["--data", str(data), "--tokenizer", args.tokenizer, "--model", args.model, "--vocab-size", str(vocab),
              "--seq-len", str(args.seq_len), "--micro-batch-size", str(args.micro_batch_size), "--microbatches", "1",
              "--steps", str(args.steps), "--precision", "fp32", "--eval-every", "0", "--log-every", "10"]
    runs: dict[str, list[dict]] = {"packed": [], "unpacked": []}
    for r in range(args.repeats):
        for kind in runs:
            spec = RunSpec(f"{kind}-{r}", 1, [*common, *(["--no-packing"] if kind == "unpacked" else [])])
            result = execute(spec, out, timeout=3600)
            if not result.ok:
                raise SystemExit(f"error: the {kind} run failed: {result.error}")
            runs[kind].append(measured(result.summary, data=data, args=args, vocab=vocab, packing=kind == "packed"))
    table = {kind: {key: statistics.median(run[key] for run in done) for key in done[0]} for kind, done in runs.items()}
    (out / "results.json").write_text(json.dumps({"runs": runs, "medians": table}, indent=2) + "\n")
    for kind, row in table.items():
        print(f"{kind:>9}: {row['windows_per_epoch']:,.0f} windows of {args.seq_len} + 1 ({row['fill']:.1%} filled); "
              f"{row['tokens_per_sec']:,.0f} tokens/s, {row['conversation_tokens_per_sec']:,.0f} conversation tokens/s, "
              f"{row['trained_tokens_per_sec']:,.0f} trained tokens/s")
    ratio = table["packed"]["conversation_tokens_per_sec"] / table["unpacked"]["conversation_tokens_per_sec"]
    print(f"packed / unpacked, conversation tokens/s: {ratio:.2f}x; wrote {out / 'results.json'}")
    return 0


def conversations(n: int, *, longest: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)

    def words(most: int) -> str:
        return " ".join(rng.choices(WORDS, k=max(1, round(math.exp(rng.uniform(0, math.log(most)))))))

    records = []
    for _ in range(n):
        messages = []
        for _ in range(rng.randint(1, 3)):
            messages += [{"role": "user", "content": words(30)}, {"role": "assistant", "content": words(longest)}]
        records.append({"messages": messages})
    return records


def measured(summary: dict, *, data: Path, args: argparse.Namespace, vocab: int, packing: bool) -> dict:
    """Per second of the run's fastest step after the first: window tokens, and the mean conversation and trained
    tokens of the windows its steps read (the same data, built as the run built it)."""
    batch = args.micro_batch_size
    sources = build_data(str(data), vocab_size=vocab, seq_len=args.seq_len, global_batch_size=batch, seed=SEED,
                         val_fraction=0.1, tokenizer=args.tokenizer,
                         packing=PackingOptions(args.seq_len, packing=packing))
    corpus = sources.train.components[0].corpus
    per_step = []
    for step in range(args.steps):
        windows = sources.train.columns(step, 0, batch).windows
        per_step.append((sum(p.length for _, g in windows for p in corpus.layout[g]), sources.train.trained_targets(step)))
    seconds = min(summary["step_times"][1:])
    return {"windows_per_epoch": corpus.windows, "fill": corpus.fill, "best_step_s": seconds,
            "median_step_s": summary["step_time_s"], "tokens_per_sec": batch * args.seq_len / seconds,
            "conversation_tokens_per_sec": statistics.mean(c for c, _ in per_step) / seconds,
            "trained_tokens_per_sec": statistics.mean(t for _, t in per_step) / seconds}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
