"""The checkpoint benchmark's runs and its arithmetic (study/checkpointing.py)."""

from pathlib import Path

import pytest

from runtime.commands.flags import parse_train_config
from runtime.lab.study import plan
from runtime.lab.study.checkpointing import checkpoint_specs, checkpoint_summary


def test_every_planned_run_is_a_valid_job():
    for settings in (plan.FULL, plan.QUICK, plan.SMOKE):
        for spec in checkpoint_specs(8, settings.checkpoint_bench, Path("study")):
            parse_train_config(spec.args, world_size=spec.nproc)  # raises on an invalid run


@pytest.mark.parametrize("world,mesh", [(8, (2, 2, 2)), (4, (1, 2, 2)), (2, (1, 2, 1))])
def test_the_mesh_follows_the_world_and_only_checkpointing_flags_differ(world, mesh, tmp_path):
    specs = checkpoint_specs(world, plan.FULL.checkpoint_bench, tmp_path)
    pause = [s for s in specs if s.meta["kind"] == "pause"]
    assert {s.meta["mode"] for s in pause} == {"none", "foreground", "background"} and len(pause) == 6
    for spec in specs:
        cfg = parse_train_config(spec.args, world_size=spec.nproc)
        assert (cfg.plan.dp, cfg.plan.pp, cfg.plan.mp) == mesh
        assert (cfg.checkpoint.dir is None) == (spec.meta["mode"] == "none")
        assert cfg.checkpoint.async_write == (spec.meta["mode"] == "background")
        if cfg.checkpoint.dir:
            assert Path(cfg.checkpoint.dir).is_relative_to(tmp_path / spec.name)
    strip = lambda args: args[:args.index("--checkpoint-dir")] if "--checkpoint-dir" in args else args  # noqa: E731
    assert len({tuple(strip(s.args)) for s in pause}) == 1
    # Repetitions alternate the order against drift.
    assert [s.meta["mode"] for s in pause[:3]] == [s.meta["mode"] for s in pause[3:]][::-1]
    steady = [s for s in specs if s.meta["kind"] == "steady"]
    assert {s.meta["mode"] for s in steady} == {"none", "background"}


def _run(mode, rnd, train_time, pauses, peaks, kind="pause"):
    return {"name": f"{kind}_{mode}_r{rnd}", "ok": True, "kind": kind, "mode": mode, "round": rnd,
            "summary": {"train_time_s": train_time, "checkpoint_pauses_s": pauses, "peak_bytes_by_step": peaks}}


def test_the_last_save_is_left_out_and_times_are_against_the_same_repetition():
    mib = 2**20
    runs = [_run("none", 0, 10.0, {}, {"25": 100 * mib, "50": 110 * mib, "300": 111 * mib}),
            _run("foreground", 0, 14.0, {"4": 1.0, "8": 3.0, "12": 9.0}, {"50": 120 * mib, "300": 150 * mib}),
            _run("background", 0, 12.0, {"4": 0.2, "8": 0.4, "12": 9.0}, {"50": 120 * mib, "300": 121 * mib}),
            _run("none", 1, 20.0, {}, {"50": 100 * mib})]
    s = checkpoint_summary(runs)
    rows = {r["mode"]: r for r in s["pause"]}
    assert rows["foreground"]["pause_mean_s"] == pytest.approx(2.0) and rows["foreground"]["pause_max_s"] == 3.0
    assert rows["background"]["pause_mean_s"] == pytest.approx(0.3)
    assert s["background_over_foreground_pause"] == pytest.approx(0.15)
    assert rows["foreground"]["train_time_vs_none_by_round"] == [pytest.approx(1.4)]
    assert rows["none"]["pause_mean_s"] is None and rows["none"]["train_time_vs_none"] == 1.0
    # Memory from step 50 (past warm-up allocations) to the last logged step.
    first = next(r for r in s["steady"] if r["name"] == "pause_none_r0")
    assert (first["early_step"], first["middle_step"], first["last_step"]) == (50, 50, 300)
    assert first["growth_mib"] == pytest.approx(1.0) and first["second_half_growth_mib"] == pytest.approx(1.0)
