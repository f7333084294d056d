"""``python run.py data-benchmark``: is the data loader ever the bottleneck?

    python run.py data-benchmark                          # README run + a 4 GB token file on 8 readers
    python run.py data-benchmark --summary LOGDIR/summary.json --gigabytes 8

Two measurements, written to ``--out`` (results.json) and printed:

1. **Loader share of the README run** (2x2x2, tiny, fp16, builtin text): the run's steady step time (run
   here, or read from ``--summary``) against the time one rank spends getting its rows of a step
   (``rows`` + ``inputs_and_targets``, what training.loop does), averaged over ``--steps`` steps.
2. **Token-file reading**: a ``--gigabytes`` nanoGPT file of uint16 tokens written to a temporary folder,
   then ``--ranks`` processes that each build the data (the first pays the vocabulary scan, cached for
   the others) and read their rows of ``--steps`` global batches of ``--batch`` x (``--seq-len`` + 1)
   tokens: tokens per second per rank; each reader's private memory growth (RssAnon) and the file pages
   it maps (RssFile, the page cache every reader shares); and the machine's used memory (MemTotal -
   MemAvailable: page cache excluded) before the readers start and at its peak, against the file's size.

Timings depend on the machine's load: run it on a quiet machine for numbers to report.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from runtime.commands.launch import RunSpec, execute
from runtime.distributed.spawn import SpawnError, spawn_ranks
from runtime.engine.data import build_data, inputs_and_targets, replica_rows

README_ARGS = ["--dp", "2", "--pp", "2", "--mp", "2", "--model", "tiny", "--precision", "fp16"]
README_BATCH, README_DP, README_SEQ = 32, 2, 64  # micro-batch 4 x 2pp micro-batches x dp 2; tiny's sequence
VOCAB = 50257  # GPT-2's: the token file's ids


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="run.py data-benchmark", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="data_benchmark", help="folder for results.json and the README run's logs")
    p.add_argument("--summary", help="summary.json of a README run to take the step time from (else run it)")
    p.add_argument("--readme-steps", type=int, default=30, help="steps of the README run when it is run here")
    p.add_argument("--gigabytes", type=float, default=4.0, help="size of the token file to write and read")
    p.add_argument("--ranks", type=int, default=8, help="processes reading the token file at once")
    p.add_argument("--steps", type=int, default=50, help="global batches each measurement reads")
    p.add_argument("--batch", type=int, default=64, help="global batch (rows) of the token-file measurement")
    p.add_argument("--seq-len", type=int, default=1024, help="sequence length of the token-file measurement")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"readme_run": loader_share(args, out), "token_file": token_file_reading(args)}
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    share, reading = results["readme_run"], results["token_file"]
    print(f"README run: loader {share['loader_s_per_step'] * 1e3:.2f} ms of a {share['step_time_s']:.3f} s step "
          f"({100 * share['loader_share']:.3f}%)")
    print(f"{reading['file_gb']:.2f} GB token file, {reading['ranks']} readers: "
          f"{reading['tokens_per_s_per_rank_median']:,.0f} tokens/s per rank (min "
          f"{reading['tokens_per_s_per_rank_min']:,.0f}); first build (scan) {reading['first_build_s']:.1f} s; "
          f"private memory +{1e3 * reading['private_growth_gb_per_rank_max']:.1f} MB per rank at most, file pages "
          f"mapped {1e3 * reading['mapped_file_gb_per_rank_max']:.0f} MB (shared); machine used memory "
          f"+{reading['used_memory_growth_gb']:.2f} GB with the readers' start-up (the file x ranks = "
          f"{reading['file_gb'] * reading['ranks']:.1f} GB)")
    print(f"wrote {out / 'results.json'}")
    return 0


def loader_share(args: argparse.Namespace, out: Path) -> dict:
    """The README run's step time against one rank's loader time per step."""
    if args.summary:
        summary = json.loads(Path(args.summary).read_text())
    else:
        run = execute(RunSpec("readme", 8, [*README_ARGS, "--steps", str(args.readme_steps)]), out, timeout=3600)
        if not run.ok:
            raise SystemExit(f"error: the README run failed: {run.error}")
        summary = run.summary
    data = build_data("builtin", vocab_size=256, seq_len=README_SEQ, global_batch_size=README_BATCH, seed=1234,
                      val_fraction=0.1)
    rows = replica_rows(README_BATCH, 0, README_DP)
    start = time.perf_counter()
    for step in range(args.steps):
        inputs_and_targets(data.train.rows(step, *rows))
    per_step = (time.perf_counter() - start) / args.steps
    return {"step_time_s": summary["step_time_s"], "loader_s_per_step": per_step,
            "loader_share": per_step / summary["step_time_s"], "rows_per_rank": rows[1] - rows[0]}


def token_file_reading(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="data_benchmark_") as tmp:
        path = Path(tmp) / "train.bin"
        _write_token_file(path, int(args.gigabytes * 1e9) // 2)
        cache = Path(tmp) / "cache"
        before = _used_memory()
        peak = _PeakSampler()
        with peak:
            try:
                spawn_ranks(_read_rows, world_size=args.ranks, timeout=3600,
                            args=(str(path), str(cache), tmp, args.batch, args.seq_len, args.steps, args.ranks))
            except SpawnError as e:
                raise SystemExit(f"error: a reader failed: {str(e)[-2000:]}") from None
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.ranks)]
        rates = [r["tokens_per_s"] for r in ranks]
        return {"file_gb": path.stat().st_size / 1e9, "ranks": args.ranks, "batch": args.batch, "seq_len": args.seq_len,
                "steps": args.steps, "tokens_per_s_per_rank_median": statistics.median(rates),
                "tokens_per_s_per_rank_min": min(rates), "first_build_s": max(r["build_s"] for r in ranks),
                "private_growth_gb_per_rank_max": max(r["private_growth_bytes"] for r in ranks) / 1e9,
                "mapped_file_gb_per_rank_max": max(r["mapped_file_bytes"] for r in ranks) / 1e9,
                # the whole machine, the readers' start-up (torch imported in each) and other load included
                "used_memory_before_gb": before / 1e9, "used_memory_peak_gb": peak.peak / 1e9,
                "used_memory_growth_gb": (peak.peak - before) / 1e9}


def _write_token_file(path: Path, n_tokens: int) -> None:
    """Seeded random GPT-2 token ids, written 32 Mi tokens at a time."""
    g = torch.Generator().manual_seed(0)
    piece = 1 << 25
    buffer = bytearray(2 * piece)
    with open(path, "wb") as f:
        for start in range(0, n_tokens, piece):
            n = min(piece, n_tokens - start)
            torch.frombuffer(buffer, dtype=torch.uint16, count=n).copy_(
                torch.randint(0, VOCAB, (n,), generator=g, dtype=torch.int32).to(torch.uint16))
            f.write(memoryview(buffer)[: 2 * n])


def _read_rows(path: str, cache: str, out: str, batch: int, seq_len: int, steps: int, ranks: int) -> None:
    """One reader (a DP rank): build the data as training does, then read its rows of ``steps`` batches."""
    rank = int(os.environ["RANK"])
    os.environ["XDG_CACHE_HOME"] = cache
    private_before, mapped_before = _rss("RssAnon"), _rss("RssFile")
    start = time.perf_counter()
    data = build_data(path, vocab_size=VOCAB, seq_len=seq_len, global_batch_size=batch, seed=1, val_fraction=0.01)
    built = time.perf_counter() - start
    rows = replica_rows(batch, rank, ranks)
    start = time.perf_counter()
    for step in range(steps):
        inputs_and_targets(data.train.rows(step, *rows))
    seconds = time.perf_counter() - start
    tokens = steps * (rows[1] - rows[0]) * (seq_len + 1)
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "tokens_per_s": tokens / seconds, "build_s": built,
        "private_growth_bytes": _rss("RssAnon") - private_before,  # memory of its own the loader took
        "mapped_file_bytes": _rss("RssFile") - mapped_before}))  # file pages it touched: the shared page cache


def _rss(field: str) -> int:
    """This process's resident memory of one kind (/proc/self/status), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return 1024 * int(line.split()[1])
    return 0


def _used_memory() -> int:
    """Bytes in use on the machine, page cache excluded (MemTotal - MemAvailable)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return 1024 * (int(fields["MemTotal"].split()[0]) - int(fields["MemAvailable"].split()[0]))


class _PeakSampler:
    """The largest ``_used_memory`` seen while the block runs (sampled every 50 ms)."""

    def __enter__(self) -> "_PeakSampler":
        self.peak, self.done = _used_memory(), threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.done.wait(0.05):
            self.peak = max(self.peak, _used_memory())

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
