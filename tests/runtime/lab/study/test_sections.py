"""The study's sections (study/sections.py) turning runs into results, on faked runs: what each runs, what it
records and under which results.json keys."""

import dataclasses

import pytest

from runtime.commands.launch import RunResult
from runtime.lab.study import checkpointing, cli, plan, sections


class FakeRunner:
    """Stands for StudyRunner: ``summary(spec)`` gives each run's figures (None: the run fails); every run's
    progress detail is worded, as the real runner does."""

    def __init__(self, out, summary):
        self.out, self.summary, self.ran = out, summary, []

    def run(self, spec, detail):
        self.ran.append(spec.name)
        summary = self.summary(spec)
        result = RunResult(spec.name, "cmd", summary is not None, 1.0, summary, None if summary else "failed", False,
                           spec.meta)
        if result.ok:
            assert detail(result)
        return result.to_dict()


def test_throughput_records_a_skipped_configuration_without_running_it(tmp_path):
    settings = dataclasses.replace(plan.QUICK, throughput_schedules=("naive", "interleaved-1f1b v=4"))
    specs = [s for s in plan.throughput_specs(4, settings) if s.meta["group"] == "pp=4"]
    assert [s.meta.get("skipped") is not None for s in specs] == [False, True]
    runner = FakeRunner(tmp_path, lambda spec: None)
    results = sections.throughput_results(specs, runner, settings)
    assert runner.ran == [specs[0].name]
    assert set(results) == {"throughput", "time_split", "timelines"}
    table = {r["label"]: r for r in results["throughput"]["table"]}
    assert "needs >= 16 layers" in table["interleaved-1f1b v=4"]["skipped"] and table["naive"]["failed"] == "failed"
    assert results["time_split"]["rows"] == [] and results["timelines"] == {}


def test_the_memory_search_finds_each_precisions_largest_batch_within_the_budget(tmp_path):
    per_sample = {"fp32": 4e6, "fp16": 2.5e6, "bf16": 2.5e6}  # bytes of peak tensor memory per sample

    def summary(spec):
        peak = per_sample[spec.meta["precision"]] * spec.meta["micro_batch_size"]
        return {"peak_tensor_bytes": peak, "peak_bytes": 2 * peak}

    settings = dataclasses.replace(plan.SMOKE, memory_budget_gb=40e6 / 2**30, memory_start=2, memory_resolution=0.0)
    runner = FakeRunner(tmp_path, summary)
    memory = sections.memory_results([], runner, settings)["memory"]
    search = memory["search"]
    assert search["fp32"]["max_micro_batch"] == 10 and search["fp32"]["first_failing"] == 11
    assert search["fp16"]["max_micro_batch"] == 16 and search["fp16"]["trials"][0]["micro_batch_size"] == 10
    assert memory["fp16_over_fp32"] == pytest.approx(1.6) and memory["budget_gb"] == settings.memory_budget_gb
    assert memory["fp16_over_fp32_bounds"] == pytest.approx([16 / 11, 17 / 10])
    assert "'layers': 2, 'd_model': 32" in memory["method"]


def test_the_sections_with_a_model_print_its_sizes(tmp_path):
    settings = plan.SMOKE
    runner = FakeRunner(tmp_path, lambda spec: {"samples_per_sec": 2.0, "step_time_s": 16.0, "step_times": [16.0]})
    replicate = sections.replicate_results([], runner, settings)["replicate"]
    assert "'layers': 2, 'd_model': 32, 'heads': 2" in replicate["method"]
    zero_bubble = sections.zero_bubble_results([], runner, settings)["zero_bubble"]
    assert zero_bubble["model"] == "4 x d 32" and "'family': 'gpt2', 'layers': 4" in zero_bubble["method"]


def test_every_section_has_a_results_function():
    assert tuple(sections.SECTION_RESULTS) == cli.SECTIONS == tuple(cli.SECTION_SPECS)


def test_checkpointing_runs_leave_no_checkpoints_and_name_the_models_flags(tmp_path):
    specs = checkpointing.checkpoint_specs(2, plan.SMOKE.checkpoint_bench, tmp_path)
    for spec in specs:
        (checkpointing.checkpoint_dir(tmp_path, spec.name) / "step_2").mkdir(parents=True)
    runner = FakeRunner(tmp_path, lambda spec: {"train_time_s": 4.0, "checkpoint_pauses_s": {"2": 0.5, "4": 0.7},
                                                "peak_bytes_by_step": {"2": 2**20, "4": 2**20}})
    section = sections.checkpointing_results(specs, runner, plan.SMOKE)["checkpointing"]
    assert runner.ran == [s.name for s in specs] and len(section["runs"]) == len(specs)
    assert not any(checkpointing.checkpoint_dir(tmp_path, s.name).exists() for s in specs)
    assert section["method"].startswith("1x2x1 mesh; pause runs: flags --model tiny --layers 4 --d-model 32")
    assert {r["mode"]: r["pause_mean_s"] for r in section["summary"]["pause"]} == {"foreground": 0.5, "background": 0.5}
