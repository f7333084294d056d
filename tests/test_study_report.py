"""Report targets and conclusions are computed from the numbers handed to them."""

import pytest

from runtime.commands.study import analysis, report


def _run(label, sps, group="pp=2", schedule=None, v=1, ok=True, compute_s=1.6):
    """A profiled run: ``compute_s`` forward + backward seconds per step on each of its 2 ranks."""
    step = 32 / sps
    steps = [1.0, 1.0, 1.0, step, step, step]
    per_rank = [{"rank": r, "step_time": step, "forward_fraction": compute_s / step / 3,
                 "backward_fraction": 2 * compute_s / step / 3} for r in range(2)]
    summary = {"samples_per_sec": sps, "step_time_s": step, "tokens_per_sec": sps * 128, "step_times": steps,
               "mfu": 0.1, "profile": {"mean_fraction": {"idle": 0.5 if label == "naive" else 0.05},
                                       "per_rank": per_rank}}
    return {"name": label, "ok": ok, "summary": summary, "error": None, "group": group, "label": label,
            "schedule": schedule or label.split(" ")[0], "pp": 2, "dp": 1, "mp": 1, "v": v, "m": 8}


def test_targets_read_each_figure_from_its_own_section():
    runs = [_run("naive", 10.0), _run("1f1b", 17.5), _run("interleaved-1f1b v=2", 18.3, v=2)]
    results = {
        "throughput": {"runs": runs, "table": analysis.throughput_table(runs)},
        "overhead": {"summary": {"engine_over_plain": 0.97}},
        "memory": {"fp16_over_fp32": 1.5},
        "split": {"table": [{"pp": 4, "auto_over_uniform": 1.3}]},
    }
    targets = {t["target"].split(" vs")[0].split(" within")[0]: t for t in report.targets(results)}
    assert targets["interleaved-1f1b (v=2)"]["measured"] == "1.830x" and targets["interleaved-1f1b (v=2)"]["met"]
    assert targets["1f1b"]["measured"] == "1.750x" and targets["1f1b"]["met"]
    assert targets["engine 1x1x1"]["measured"] == "0.970x" and targets["engine 1x1x1"]["met"]
    assert targets["fp16 max micro-batch"]["measured"] == "1.50x" and not targets["fp16 max micro-batch"]["met"]
    assert targets["--split auto"]["measured"] == "1.300x" and targets["--split auto"]["met"]


def test_conclusions_name_the_fastest_schedule_and_its_bound():
    runs = [_run("naive", 10.0), _run("1f1b", 17.0)]
    results = {"throughput": {"runs": runs, "table": analysis.throughput_table(runs)}}
    text = " ".join(report.conclusions(results, cores=2))
    assert "fastest schedule is 1f1b at 17.00 samples/s, 1.70x" in text and "bound 1.78x" in text


def test_the_bound_is_corrected_by_the_measured_compute_slowdown():
    # naive: 1.6 s of compute per rank per step; 1f1b: 1.76 s, i.e. ranks computed 10% slower together.
    runs = [_run("naive", 10.0), _run("1f1b", 16.0, compute_s=1.76)]
    row = next(r for r in analysis.throughput_table(runs) if r["label"] == "1f1b")
    assert row["compute_slowdown"] == pytest.approx(1.1)
    assert row["theoretical_speedup"] == pytest.approx((1 - 1 / 9) / (1 - 1 / 2))
    assert row["bound_at_measured_compute"] == pytest.approx(row["theoretical_speedup"] / 1.1)
    text = " ".join(report.conclusions({"throughput": {"runs": runs, "table": analysis.throughput_table(runs)}}, cores=2))
    assert "took 1.10x its time under naive" in text and "bound at that compute speed is 1.62x" in text


def test_split_expectation_is_the_flow_shop_makespan_at_the_busiest_cores_pace():
    # One micro-batch: the sum of the stages (fill and drain only).
    assert analysis.pipeline_time_units([1, 2, 3, 4], pp=4, cores=4, microbatches=1) == 10
    # m micro-batches: sum(c) + (m - 1) * max(c); looped placement sums a rank's stages (r, r + pp, ...).
    assert analysis.pipeline_time_units([1, 1, 1, 5], pp=4, cores=4, microbatches=8) == 8 + 7 * 5
    assert analysis.pipeline_time_units([1, 2, 3, 4], pp=2, cores=2, microbatches=8) == 10 + 7 * 6
    # Four ranks on two cores, packed longest first: each core runs two ranks' work (pace 2).
    assert analysis.pipeline_time_units([1, 1, 1, 1], pp=4, cores=2, microbatches=8) == 4 + 7 * 2

    def run(split, sps, costs, rnd=0):
        summary = {"samples_per_sec": sps, "step_time_s": 8 / sps, "step_times": [8 / sps] * 5,
                   "blocks_per_stage": [], "stage_costs": costs}
        return {"ok": True, "summary": summary, "pp": 4, "split": split, "m": 8, "round": rnd}

    row = analysis.split_table([run("auto", 12.0, [3, 3, 2, 10]), run("uniform", 10.0, [2, 2, 2, 12])], cores=2)[0]
    assert row["auto_over_uniform"] == pytest.approx(1.2)
    # uniform 18 + 7 * 12 = 102, auto 18 + 7 * 10 = 88: fill and drain dilute the 12 / 10 of the busiest stage.
    assert row["expected_core_per_rank"] == pytest.approx(102 / 88)
    assert row["expected_on_cores"] == pytest.approx(102 / 88)  # the heavy stage has a core alone in both
    row = analysis.split_table([run("auto", 10.0, [3, 3, 3, 5]), run("uniform", 10.0, [2, 2, 2, 8])], cores=2)[0]
    assert row["expected_core_per_rank"] == pytest.approx((14 + 7 * 8) / (14 + 7 * 5))
    # On two cores both splits pack to a busiest core of 8 ([5, 3] and [3, 3] / [8] and [2, 2, 2]): no gain.
    assert row["expected_on_cores"] == pytest.approx(1.0)
    # From measured layer times [embedding, 8 blocks, head]: auto stages [2, 3, 3, 9], uniform [2, 2, 2, 11].
    timed = [run("auto", 10.0, [1]), run("uniform", 10.0, [1])]
    timed[0]["summary"]["blocks_per_stage"], timed[1]["summary"]["blocks_per_stage"] = [2, 3, 3, 0], [2, 2, 2, 2]
    row = analysis.split_table(timed, cores=2, layer_seconds=[0.0] + [1.0] * 8 + [9.0])[0]
    assert row["measured_expected_core_per_rank"] == pytest.approx((17 + 7 * 11) / (17 + 7 * 9))
    assert row["measured_expected_on_cores"] == pytest.approx((17 + 7 * 11) / (17 + 7 * 9))
    assert "measured_expected_core_per_rank" not in analysis.split_table(timed, cores=2)[0]
    # Each repetition's own ratio, next to the pooled one.
    runs = [run("auto", 12.0, [1], 0), run("uniform", 10.0, [1], 0), run("uniform", 10.0, [1], 1), run("auto", 11.0, [1], 1)]
    assert analysis.split_table(runs, cores=2)[0]["auto_over_uniform_by_round"] == pytest.approx([1.2, 1.1])


def test_targets_show_each_repetitions_ratio():
    runs = [{**_run("naive", 10.0), "round": 0}, {**_run("1f1b", 18.0), "round": 0},
            {**_run("1f1b", 16.0), "round": 1}, {**_run("naive", 10.0), "round": 1}]
    table = analysis.throughput_table(runs)
    row = next(r for r in table if r["label"] == "1f1b")
    assert row["speedup_by_round"] == pytest.approx([1.8, 1.6])
    target = next(t for t in report.targets({"throughput": {"runs": runs, "table": table}}) if t["target"].startswith("1f1b"))
    assert target["measured"].endswith("(repetitions: 1.80x, 1.60x)")


def test_split_section_states_the_measured_head_cost():
    runs = [{"ok": True, "pp": 2, "split": split, "m": 8, "round": 0, "micro_batch_size": 2,
             "summary": {"samples_per_sec": sps, "step_time_s": 1.0, "step_times": [1.0] * 3,
                         "blocks_per_stage": blocks, "stage_costs": [1.0, 1.0]}}
            for split, sps, blocks in (("auto", 11.0, [3, 1]), ("uniform", 10.0, [2, 2]))]
    seconds = [0.001, 0.02, 0.02, 0.02, 0.02, 0.18]
    split = {"runs": runs, "table": analysis.split_table(runs, cores=2, layer_seconds=seconds),
             "model": {"layers": 4}, "layer_seconds": seconds}
    text = "\n".join(report._split_section({"split": split}))
    assert "a block 20.0 ms, the head 180.0 ms = 9.0 blocks" in text
    # auto [3, 1] -> stages [0.061, 0.2], uniform [2, 2] -> [0.041, 0.22]: (0.261 + 7 * 0.22) / (0.261 + 7 * 0.2)
    assert "| 1.100x | 1.10x | 1.00x | 1.00x (2 cores) | 1.08x | 1.08x |" in text
