"""Report targets and conclusions are computed from the numbers handed to them."""

import re
import xml.etree.ElementTree as ET

import pytest

from runtime.lab.study import analysis, charts, report, sharding
from runtime.observe.profiling import CATEGORIES


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


def test_v_split_expectation_pairs_each_ranks_stages_and_sets_its_target():
    # V placement on pp=2: rank 0 runs stages 0 and 3, rank 1 stages 1 and 2 (looped would pair 0-2 and 1-3).
    assert analysis.pipeline_time_units([1, 2, 3, 4], pp=2, cores=2, microbatches=8, placement="v") == 10 + 7 * 5
    assert analysis.pipeline_time_units([1, 2, 3, 4], pp=2, cores=2, microbatches=8) == 10 + 7 * 6

    def run(schedule, split, sps):
        summary = {"samples_per_sec": sps, "step_time_s": 8 / sps, "step_times": [8 / sps] * 5,
                   "blocks_per_stage": [1, 1, 1, 1] if split == "uniform" else [1, 2, 1, 0],
                   "stage_costs": [1.0, 1.0, 1.0, 1.0]}
        return {"ok": True, "summary": summary, "pp": 2, "schedule": schedule, "split": split, "m": 8, "round": 0}

    runs = [run("1f1b", "auto", 10.0), run("1f1b", "uniform", 10.0), run("zbv", "auto", 12.0), run("zbv", "uniform", 10.0)]
    # [embedding, 4 blocks, head] with a head worth 3 blocks.
    table = analysis.split_table(runs, cores=2, layer_seconds=[0.0, 1.0, 1.0, 1.0, 1.0, 3.0])
    rows = {r["schedule"]: r for r in table}
    assert set(rows) == {"1f1b", "zbv"} and rows["zbv"]["auto_over_uniform"] == pytest.approx(1.2)
    # uniform: stages [1, 1, 1, 4], V ranks [5, 2]; auto: stages [1, 2, 1, 3], V ranks [4, 3].
    assert rows["zbv"]["measured_expected_core_per_rank"] == pytest.approx((7 + 7 * 5) / (7 + 7 * 4))
    # The same blocks on the looped placement: uniform ranks [2, 5], auto [2, 5]: no gain expected.
    assert rows["1f1b"]["measured_expected_core_per_rank"] == pytest.approx(1.0)
    row = {"schedule": "zbv", "pp": 4, "auto_over_uniform": 1.2, "auto_over_uniform_by_round": [1.2],
           "measured_expected_on_cores": 1.25}
    target = next(t for t in report.targets({"split": {"table": [row]}}) if t["target"].startswith("V-aware"))
    assert "predicted 1.25x" in target["target"] and target["goal"] == ">= 1.19x" and target["met"]
    row["auto_over_uniform"] = 1.1
    target = next(t for t in report.targets({"split": {"table": [row]}}) if t["target"].startswith("V-aware"))
    assert not target["met"]


def test_zero_bubble_targets_read_each_schedules_row():
    from runtime.lab.study import zero_bubble

    runs = [{"ok": True, "label": s, "round": 0,
             "summary": {"samples_per_sec": sps, "step_time_s": 32 / sps, "step_times": [32 / sps] * 4}}
            for s, sps in (("naive", 10.0), ("zbv", 18.6), ("interleaved-1f1b v=2", 17.9), ("1f1b", 17.2),
                           ("interleaved-1f1b v=2 --compile", 17.1))]
    table = zero_bubble.zero_bubble_summary(runs)
    assert [r["label"] for r in table][-1] == "interleaved-1f1b v=2 --compile"
    assert table[-1]["speedup_vs_naive"] == pytest.approx(1.71)
    zbv = next(r for r in table if r["schedule"] == "zbv")
    assert zbv["speedup_vs_naive"] == pytest.approx(1.86) and zbv["bound"] == pytest.approx(2.0)
    targets = {t["target"].split(" vs ")[0]: t for t in report.targets({"zero_bubble": {"table": table}})}
    assert targets["zbv"]["measured"] == "1.860x" and targets["zbv"]["met"]
    assert targets["1f1b"]["measured"] == "1.720x" and targets["1f1b"]["met"]
    assert targets["interleaved-1f1b v=2"]["measured"] == "1.790x" and not targets["interleaved-1f1b v=2"]["met"]


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


def _scaling_run(kind, world, sps, dp=1, pp=1, mp=1):
    summary = {"samples_per_sec": sps, "step_time_s": 32 / sps, "step_times": [32 / sps] * 4,
               "profile": {"mean_fraction": {"forward": 0.3, "backward": 0.5, "pp_send_recv": 0.05, "idle": 0.1}}}
    return {"ok": True, "summary": summary, "error": None, "kind": kind, "world": world, "dp": dp, "pp": pp, "mp": mp}


def _full_results() -> dict:
    """A results dict with every section, as cli.py assembles it (figures invented)."""
    runs = [_run("naive", 10.0), _run("1f1b", 17.5), _run("interleaved-1f1b v=2", 18.3, v=2)]
    scaling = [_scaling_run("single", 1, 10.0), _scaling_run("DP", 2, 18.0, dp=2), _scaling_run("PP", 2, 16.0, pp=2),
               _scaling_run("MP", 2, 14.0, mp=2), _scaling_run("mix", 4, 20.0, dp=2, pp=2)]
    split_row = {r: 0.1 for r in CATEGORIES}
    time_split = [{"group": "pp=2", "label": "1f1b", "rank": rank, "step_time": 1.0, **split_row, "forward": 0.3,
                   "tracked_fraction": 0.95, "theoretical_bubble": 0.1} for rank in (0, 1)]
    trials = [{"micro_batch_size": 4, "peak_gb": 0.01, "resident_gb": 0.5, "ok": True},
              {"micro_batch_size": 8, "peak_gb": 0.03, "resident_gb": 0.6, "ok": True}]
    search = {p: {"max_micro_batch": 4, "first_failing": 8, "peak_gb_at_max": 0.01, "trials": trials}
              for p in ("fp32", "fp16", "bf16")}
    return {
        "command": "python run.py study", "mode": "smoke", "started": "today", "wall_time_s": 60.0, "commands": [],
        "machine": {"device": "cpu", "torch": "2", "python": "3", "cores": 2},
        "settings": {"model": {}, "micro_batch_size": 4, "microbatches": 8, "steps": 3,
                     "sections": ["throughput", "memory", "scaling", "overhead", "split"]},
        "throughput": {"runs": runs, "table": analysis.throughput_table(runs)},
        "time_split": {"rows": time_split, "method": "hooks", "bottlenecks": []},
        "scaling": {"runs": scaling, "table": analysis.scaling_table(scaling, cores=2)},
        "overhead": {"runs": [], "summary": {"engine_samples_per_sec": 9.7, "plain_samples_per_sec": 10.0,
                                             "engine_over_plain": 0.97, "repetitions": 1}},
        "memory": {"budget_gb": 0.02, "method": "search", "search": search, "fp16_over_fp32": 1.0, "bf16_over_fp32": 1.0},
    }


def test_a_study_of_some_sections_reports_only_what_it_ran(tmp_path):
    results = _full_results()
    results["settings"]["sections"] = ["memory", "overhead"]
    for section in ("throughput", "time_split", "scaling"):
        del results[section]
    names = [t["target"] for t in report.targets(results)]
    assert names == ["engine 1x1x1 within 5% of a plain PyTorch loop", "fp16 max micro-batch vs fp32, same budget"]
    results["charts"] = charts.write_charts(results, tmp_path)
    text = report.render(results, cores=2)
    assert "## Targets" in text and "## 2. Memory" in text and "## Engine overhead" in text
    for absent in ("## 1. Throughput", "## 3. Where the time goes", "## 5. Scaling", "interleaved-1f1b (v=2)", "1f1b vs"):
        assert absent not in text
    # No section that ran has a target: no targets table at all.
    results["settings"]["sections"] = ["memory"]
    del results["overhead"]
    assert [t["target"] for t in report.targets(results)] == ["fp16 max micro-batch vs fp32, same budget"]
    del results["memory"]
    assert report.targets(results) == [] and "## Targets" not in report.render(results, cores=2)


def test_charts_are_drawn_for_the_sections_that_ran_and_embedded_in_the_report(tmp_path):
    results = _full_results()
    paths = charts.write_charts(results, tmp_path)
    for name in ("throughput", "scaling", "scaling_efficiency", "time_split", "memory", "memory_batch"):
        assert paths[name] == f"charts/{name}.svg"
        root = ET.parse(tmp_path / paths[name]).getroot()
        assert root.tag == "{http://www.w3.org/2000/svg}svg"
    results["charts"] = paths
    text = report.render(results, cores=2)
    images = re.findall(r"!\[[^\]]+\]\((charts/[\w.]+\.svg)\)", text)
    assert sorted(images) == sorted(p for p in paths.values() if p)  # every drawn chart (no sharding data here)
    # Each chart sits under its own section's table.
    assert text.index("charts/throughput.svg") < text.index("## 2. Memory") < text.index("charts/memory.svg")
    throughput_svg = (tmp_path / paths["throughput"]).read_text()
    assert "pp=2: interleaved-1f1b v=2" in throughput_svg and "bubble-formula bound" in throughput_svg
    assert all(kind in (tmp_path / paths["scaling"]).read_text() for kind in ("DP", "PP", "MP", "mix / 3D", "ideal"))


def test_no_chart_for_a_section_that_did_not_run(tmp_path):
    results = _full_results()
    for section in ("throughput", "time_split", "scaling", "memory"):
        del results[section]
    assert set(charts.write_charts(results, tmp_path).values()) == {None}
    assert not (tmp_path / "charts").exists()
    results["charts"] = charts.write_charts(results, tmp_path)
    assert "![" not in report.render(results, cores=2)


def test_replicate_benchmark_pools_repetitions_and_sets_its_target():
    def run(who, r, step_time):
        return {"who": who, "round": r, "ok": True, "name": f"{who}{r}",
                "summary": {"step_time_s": step_time, "samples_per_sec": 32 / step_time}}

    runs = [run("replicate", 0, 1.0), run("ddp", 0, 1.1), run("fsdp", 0, 1.3),
            run("replicate", 1, 1.2), run("ddp", 1, 1.2), run("fsdp", 1, 1.5)]
    summary = sharding.replicate_summary(runs)
    assert summary["replicate_over_ddp_by_round"] == pytest.approx([1.1, 1.0])
    assert summary["replicate_over_ddp"] == pytest.approx(1.15 / 1.1)
    results = {"replicate": {"summary": summary, "method": "m"}, "settings": {"sections": ["replicate"]}}
    target = next(t for t in report.targets(results) if "DDP" in t["target"])
    assert target["met"] and "1.10x, 1.00x" in target["measured"]
    assert "| plain DDP loop" in "\n".join(sharding.replicate_markdown(results["replicate"]))


def test_the_experts_section_tabulates_ep_against_ep_1_and_the_load_by_step():
    from runtime.lab.study import experts

    def run(label, expert_params, step_time, peak, **extra):
        return {"label": label, "ok": True, "summary": {"local_expert_parameters_max": expert_params,
                                                        "peak_tensor_bytes": peak, "tokens_per_sec": 1000 / step_time,
                                                        "step_time_s": step_time, **extra}}

    runs = [run("ep 1", 800, 1.0, 2**30), run("ep 1", 800, 1.2, 2**30), run("ep 2", 400, 1.1, 0.75 * 2**30),
            run("ep 4", 200, 1.3, 0.6 * 2**30), run("dense", 0, 0.9, 0.5 * 2**30),
            {**run("no bias update", 400, 1.0, 1, expert_loads={"10": {"a": 3.0, "b": 2.0}}), "balance": True},
            {**run("bias update", 400, 1.0, 1, expert_loads={"10": {"a": 2.0, "b": 1.0}, "20": {"a": 1.2, "b": 1.0}}),
             "balance": True}]
    summary = experts.expert_summary(runs)
    rows = {r["label"]: r for r in summary["table"]}
    assert rows["ep 1"]["step_time_s"] == pytest.approx(1.1)  # the median of the repetitions
    assert rows["ep 2"]["expert_parameters_vs_ep1"] == 0.5 and rows["ep 4"]["expert_parameters_vs_ep1"] == 0.25
    assert rows["ep 4"]["step_time_vs_ep1"] == pytest.approx(1.3 / 1.1) and "expert_parameters_vs_ep1" not in rows["dense"]
    assert summary["balance"] == {"no bias update": {10: 2.5}, "bias update": {10: 1.5, 20: 1.1}}
    text = "\n".join(experts.experts_markdown({"summary": summary, "method": "m"}))
    assert "| ep 4 | 200 | 0.250 |" in text and "bias update: step 10 1.50, step 20 1.10" in text
