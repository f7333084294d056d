"""The long-context study section (runtime/lab/study/long_context.py) without running it: which runs it
plans, and how it reports the longest sequence each cp trains within the node's memory."""

from __future__ import annotations

from runtime.lab.study.long_context import (
    CP_DEGREES,
    RANKS,
    SELECTIVE,
    long_context_markdown,
    long_context_specs,
    long_context_summary,
    longest_sequence,
)


def test_each_cp_group_checks_the_predicted_longest_sequence_up_to_the_cap():
    specs = {s.name: s for s in long_context_specs(cp_seq_len=2048, steps=3, longest_cap=16384)}
    for cp in CP_DEGREES:
        check = specs[f"long_context_longest_cp{cp}"]
        args = check.args
        seq_len = int(args[args.index("--seq-len") + 1])
        assert seq_len == min(longest_sequence(cp, SELECTIVE), 16384 // (2 * cp * 1024) * 2 * cp * 1024)
        assert seq_len % (2 * cp * 1024) == 0 and check.nproc == cp  # one cp group: dp 1
        assert args[args.index("--dp") + 1] == "1" and args[args.index("--cp") + 1] == str(cp)
        assert "--compact-cpu-memory" in args and "selective" in args
    assert not any(name.startswith("long_context_longest") for name in
                   (s.name for s in long_context_specs(cp_seq_len=2048, steps=3)))  # no cap: not run


def test_the_more_cp_ranks_the_longer_the_predicted_sequence():
    plain = [longest_sequence(cp) for cp in CP_DEGREES]
    selective = [longest_sequence(cp, SELECTIVE) for cp in CP_DEGREES]
    assert plain == sorted(plain) and selective == sorted(selective)
    assert all(s > p for s, p in zip(selective, plain))  # selective checkpointing keeps less per layer


def test_the_report_says_whether_the_node_fits_eight_times_the_busiest_rank():
    def run(kind, cp, peak, **extra):
        return {"kind": kind, "cp": cp, "label": f"cp {cp}", "ok": True, **extra,
                "summary": {"peak_tensor_bytes": peak / 2, "predicted_peak_tensor_bytes": peak / 2,
                            "peak_bytes": peak, "step_times": [2.0], "tokens_per_sec": 10.0}}
    gib = 2**30
    runs = [run("cp", 8, 1 * gib), run("longest", 8, 2 * gib, seq_len=32768), run("longest", 1, 3 * gib, seq_len=16384)]
    summary = long_context_summary(runs)
    assert [r["node_bytes"] for r in summary["checked"]] == [RANKS * 2 * gib, RANKS * 3 * gib]
    lines = long_context_markdown({"method": "m", "summary": summary})
    assert any(line.startswith("| 8 | 32,768 |") and "| 16.00 | yes |" in line for line in lines)
    assert any(line.startswith("| 1 | 16,384 |") and "| 24.00 | no |" in line for line in lines)
