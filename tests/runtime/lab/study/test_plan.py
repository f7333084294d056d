"""The study's run list: every section's configurations, valid meshes, honest skips."""

import dataclasses

import pytest

from models import named_config
from runtime.commands.flags import parse_train_config
from runtime.lab import plain_loop
from runtime.lab.study import plan, sharding


def test_throughput_runs_cover_every_schedule_and_mesh_at_8_ranks():
    specs = plan.throughput_specs(8, plan.FULL)
    groups = {s.meta["group"] for s in specs}
    assert groups == {"pp=2", "pp=4", "3D 2x2x2"}
    for group in groups:
        labels = {s.meta["label"] for s in specs if s.meta["group"] == group}
        assert labels == {label for label, _, _ in plan.THROUGHPUT_SCHEDULES}
    pp2 = [s for s in specs if s.meta["group"] == "pp=2"]
    assert len(pp2) == plan.FULL.rounds * len(plan.THROUGHPUT_SCHEDULES)


def test_every_planned_run_has_valid_flags():
    for settings in (plan.FULL, plan.QUICK, plan.SMOKE):
        specs = (plan.throughput_specs(8, settings) + plan.scaling_specs(8, settings) + plan.split_specs(8, settings)
                 + [plan.memory_spec(settings, precision=p, micro_batch_size=8) for p in plan.PRECISIONS])
        for spec in specs:
            if spec.meta.get("skipped"):
                continue
            cfg = parse_train_config(spec.args, world_size=spec.nproc)  # raises on an invalid run
            assert cfg.plan.world == spec.nproc


def test_quick_skips_what_its_model_cannot_split():
    every_schedule = dataclasses.replace(plan.QUICK, throughput_schedules=plan.FULL.throughput_schedules)
    skipped = [s for s in plan.throughput_specs(4, every_schedule) if s.meta.get("skipped")]
    assert [(s.meta["group"], s.meta["v"]) for s in skipped] == [("pp=4", 4)]
    assert "16 layers" in skipped[0].meta["skipped"]


def test_scaling_keeps_the_global_batch():
    specs = plan.scaling_specs(8, plan.FULL)
    kinds = {(s.meta["kind"], s.meta["world"]) for s in specs}
    assert {("DP", 8), ("PP", 8), ("MP", 8), ("3D", 8), ("single", 1)} <= kinds
    for spec in specs:
        cfg = parse_train_config(spec.args, world_size=spec.nproc)
        assert cfg.global_batch_size == plan.FULL.micro_batch_size * plan.FULL.microbatches


def test_scaling_stops_at_the_world_size():
    assert max(s.meta["world"] for s in plan.scaling_specs(2, plan.QUICK)) == 2


def test_smoke_keeps_what_the_timelines_and_every_section_need():
    specs = plan.throughput_specs(4, plan.SMOKE)
    assert {(s.meta["group"], s.meta["label"]) for s in specs} == {
        (g, label) for g in ("pp=2", "pp=4") for label in ("naive", "1f1b", "interleaved-1f1b v=2")}
    assert not any(s.meta.get("skipped") for s in specs)
    assert max(s.meta["world"] for s in plan.scaling_specs(4, plan.SMOKE)) == 2
    assert [s.meta["who"] for s in plan.overhead_specs(plan.SMOKE)] == ["engine", "plain"]
    assert {s.meta["pp"] for s in plan.split_specs(4, plan.SMOKE)} == {2}


def test_repetitions_are_measured_again_but_identical_runs_of_two_sections_once():
    throughput = plan.throughput_specs(2, plan.FULL)
    interleaved = [s for s in throughput if s.meta["label"] == "interleaved-1f1b v=2"]
    assert len(interleaved) == plan.FULL.rounds == 2
    assert plan.run_key(interleaved[0]) != plan.run_key(interleaved[1])
    scaling_pp2 = next(s for s in plan.scaling_specs(2, plan.FULL) if s.meta["kind"] == "PP")
    assert plan.run_key(scaling_pp2) == plan.run_key(next(s for s in interleaved if s.meta["round"] == 0))
    keys = [plan.run_key(s) for s in plan.overhead_specs(plan.FULL)]
    assert len(set(keys)) == len(keys) == 2 * plan.FULL.overhead_pairs


def test_pipelined_scaling_meshes_keep_the_throughput_micro_batching_and_share_its_3d_run():
    scaling = plan.scaling_specs(8, plan.FULL)
    for spec in scaling:
        cfg = parse_train_config(spec.args, world_size=spec.nproc)
        if cfg.plan.pp > 1:
            assert cfg.plan.microbatches == plan.FULL.microbatches, spec.name
        else:  # no pipeline: micro-batches only accumulate, so the micro-batch stays large
            assert cfg.plan.micro_batch_size == plan.FULL.micro_batch_size, spec.name
    three_d = next(s for s in scaling if s.meta["kind"] == "3D")
    throughput_3d = next(s for s in plan.throughput_specs(8, plan.FULL)
                         if s.meta["group"] == "3D 2x2x2" and s.meta["label"] == "interleaved-1f1b v=2")
    assert plan.run_key(three_d) == plan.run_key(throughput_3d)


def test_results_print_a_models_family_and_sizes():
    assert plan.model_summary(plan.FULL.split_model) == {
        "family": "gpt2", "layers": 8, "d_model": 256, "heads": 4, "kv_heads": 4, "seq_len": 128, "vocab_size": 28672}


def test_the_engine_and_the_plain_loop_train_the_same_model():
    for settings in (plan.FULL, plan.QUICK, plan.SMOKE):
        specs = plan.overhead_specs(settings) + sharding.replicate_specs(
            1, settings.replicate_model, micro_batch_size=4, microbatches=4, steps=3)
        engine = [s for s in specs if s.kind == "engine"]
        plain = [s for s in specs if s.kind == "plain"]
        assert engine and plain
        built = {plain_loop.model_config(plain_loop.build_parser().parse_args(s.args)) for s in plain}
        assert built == {parse_train_config(s.args, world_size=s.nproc).model for s in engine}
        assert built == {settings.model, settings.replicate_model}


def test_the_plain_loop_refuses_a_model_it_cannot_build():
    tiny = named_config("tiny", n_layers=2, d_model=32, n_heads=2, seq_len=48, vocab_size=512)
    flags = plain_loop.plain_flags(tiny)
    assert flags == ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "48", "--vocab-size", "512"]
    assert plain_loop.model_config(plain_loop.build_parser().parse_args(flags)) == tiny
    for other in (named_config("tiny", n_layers=2, d_model=32, n_heads=2, seq_len=32, mlp_width=64),
                  named_config("llama3-debug")):
        with pytest.raises(ValueError, match="plain loop"):
            plain_loop.plain_flags(other)
