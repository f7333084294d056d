"""Report targets and conclusions are computed from the numbers handed to them."""

from runtime.study import analysis, report


def _run(label, sps, group="pp=2", schedule=None, v=1, ok=True):
    steps = [1.0, 1.0, 1.0, 32 / sps, 32 / sps, 32 / sps]
    summary = {"samples_per_sec": sps, "step_time_s": 32 / sps, "tokens_per_sec": sps * 128, "step_times": steps,
               "mfu": 0.1, "profile": {"mean_fraction": {"idle": 0.5 if label == "naive" else 0.05}}}
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
