"""The study command end to end, reduced (--smoke: every section, fewest runs) on up to 2 ranks.

Structure and invariants only, never speed."""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET

import pytest

from tests.launch import run_command

pytestmark = pytest.mark.slow  # real multi-process jobs

SECTIONS = ("throughput", "memory", "time_split", "timelines", "scaling", "overhead", "targets", "machine")


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    result = run_command([sys.executable, "run.py", "study", "--world", "2", "--smoke", "--out", str(out)], timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text()), result.stdout


def test_results_hold_every_section_and_the_report(study):
    out, results, stdout = study
    for section in SECTIONS:
        assert results.get(section), f"results.json lacks {section}"
    report = (out / "REPORT.md").read_text()
    for heading in ("## 1. Throughput", "## 2. Memory", "## 3. Where the time goes", "## 4. Pipeline timelines",
                    "## 5. Scaling", "## Conclusions", "## Targets"):
        assert heading in report
    commands = (out / "commands.txt").read_text().splitlines()
    assert len(commands) == len(results["commands"]) and all("run.py" in c or "plain_loop" in c for c in commands)
    assert stdout.count("[") >= len(commands)  # a progress line per run
    table = results["throughput"]["table"]
    assert {r["group"] for r in table} == {"pp=2"}  # (--world 4 adds pp=4)
    assert all(r.get("samples_per_sec") or r.get("skipped") for r in table)
    # Identical runs of two sections run once: scaling's 1x2x1 is the pp=2 interleaved throughput run.
    pp2 = next(r for r in results["scaling"]["runs"] if r["kind"] == "PP" and r["world"] == 2)
    assert pp2["reused_from"] == "throughput_pp2_interleaved-1f1b_v2_r0" and pp2["ok"]
    assert len(set(commands)) == len(commands)
    # The split benchmark binds its ranks to cores by stage cost (one core each here: 2 ranks).
    for run in results["split"]["runs"]:
        bound = run["summary"]["bound_cores"]
        assert bound is None or sorted(int(r) for r in bound) == list(range(run["pp"])), bound
    # Measured layer times [embedding, blocks..., head] give the second expectation of the split table.
    seconds = results["split"]["layer_seconds"]
    assert len(seconds) == results["split"]["model"]["layers"] + 2 and all(t > 0 for t in seconds)
    assert all(row["measured_expected_on_cores"] > 0 for row in results["split"]["table"])
    mem = results["memory"]["search"]
    assert set(mem) == {"fp32", "fp16", "bf16"} and all(m["max_micro_batch"] >= 1 for m in mem.values())
    # Memory per configuration: measured beside predicted; ZeRO-3 holds half a replica's parameters on 2 ranks.
    rows = {r["label"]: r for r in results["sharding"]["table"]}
    assert all(r["ok"] and r["peak_tensor_bytes"] > 0 and r["predicted_bytes"] > 0 for r in rows.values())
    assert rows["ZeRO-3"]["local_parameters_max"] < 0.6 * rows["replicate (DDP layout)"]["local_parameters_max"]
    assert rows["ZeRO-3"]["reduction_vs_replication"] > 1.0
    assert "## Memory per configuration" in report and "## Replicate against DistributedDataParallel" in report
    replicate = results["replicate"]["summary"]
    assert replicate["replicate_samples_per_sec"] > 0 and replicate["ddp_samples_per_sec"] > 0
    assert any("-m runtime.lab.plain_loop" in c and "nproc_per_node=2" in c for c in commands)
    # ZB-V beside the naive loop and interleaved 1F1B, with the bubble formulas' bounds (2.0x for zbv).
    zero_bubble = {r["schedule"]: r for r in results["zero_bubble"]["table"]}  # (smoke: no --compile row)
    assert set(zero_bubble) == {"naive", "zbv", "interleaved-1f1b"} and zero_bubble["naive"]["speedup_vs_naive"] == 1.0
    assert zero_bubble["zbv"]["samples_per_sec"] > 0 and zero_bubble["zbv"]["bound"] == pytest.approx(2.0)
    assert "## Zero-bubble V (zbv) against the naive loop, and compiled blocks" in report
    assert any(t["target"].startswith("zbv vs naive") for t in results["targets"])
    # Checkpoint pauses, foreground and background, timed on the same job; the checkpoints are not kept.
    pauses = {r["mode"]: r for r in results["checkpointing"]["summary"]["pause"]}
    assert set(pauses) == {"foreground", "background"}
    assert all(r["saves"] == 1 and r["pause_mean_s"] > 0 for r in pauses.values())
    assert all(r["last_mib"] >= r["early_mib"] > 0 for r in results["checkpointing"]["summary"]["steady"])
    assert "## Checkpoint pauses and steady memory" in report and not list(out.glob("checkpoint_*/checkpoints"))


def test_report_embeds_svg_charts_and_runs_land_in_the_hparams_tab(study):
    out, results, _ = study
    images = re.findall(r"!\[[^\]]+\]\((charts/[\w.]+\.svg)\)", (out / "REPORT.md").read_text())
    assert len(images) >= 4 and sorted(images) == sorted(p for p in results["charts"].values() if p)
    for path in images:
        assert ET.parse(out / path).getroot().tag == "{http://www.w3.org/2000/svg}svg", path
    assert list((out / "hparams").rglob("events.out.tfevents*"))


def _trace(out, label):
    return json.loads((out / results_path(label)).read_text())


def results_path(label):
    return f"timelines/{label.replace(' ', '_').replace('=', '')}.json"


@pytest.mark.parametrize("label,stages_per_rank", [("naive", 1), ("1f1b", 1), ("interleaved-1f1b v=2", 2)])
def test_timeline_has_a_track_per_rank_with_the_scheduled_actions(study, label, stages_per_rank):
    out, results, _ = study
    trace = _trace(out, label)
    m = results["settings"]["microbatches"]
    actions = [e for e in trace["traceEvents"] if e["ph"] == "X" and e.get("args", {}).get("kind") in ("F", "B")]
    assert {e["tid"] for e in actions} == {0, 1}  # pp=2: one track per rank
    for rank in (0, 1):
        for kind in ("F", "B"):
            mine = sorted((e["args"]["stage"], e["args"]["microbatch"]) for e in actions
                          if e["tid"] == rank and e["args"]["kind"] == kind)
            stages = [rank + 2 * i for i in range(stages_per_rank)]
            assert mine == sorted((s, mb) for s in stages for mb in range(m)), (label, rank, kind)


def test_time_split_adds_up_and_naive_idles_more(study):
    _, results, _ = study
    rows = results["time_split"]["rows"]
    assert rows
    for row in rows:
        assert row["tracked_fraction"] >= 0.9, row  # the categories explain the step within 10%
    idle = {r["label"]: r["measured_idle_fraction"] for r in results["throughput"]["table"]
            if r["group"] == "pp=2" and r.get("samples_per_sec")}
    assert idle["naive"] > idle["interleaved-1f1b v=2"]
