"""runtime/distributed/process_group.py and timeouts.py: the phases' timeouts reach every process group a
training run creates: the world's, DeviceMesh's per-dimension groups, HSDP's unflattened (replicate, shard)
groups and the background checkpoint group. Each is given a timeout where it is made (torch's module
defaults, which a group made without one takes, are 10 minutes for NCCL and 30 for gloo) and each phase
sets its own: ``--startup-timeout`` through the first step, ``--collective-timeout`` for the later ones,
``--checkpoint-timeout`` while saving; the background group keeps the checkpoint timeout throughout. On gloo
the test reads them back from every group's options, the same options DeviceMesh hands NCCL."""

from __future__ import annotations

import json

import pytest

from tests.launch import spawn_ranks

pytestmark = pytest.mark.slow  # a real 8-rank job

STARTUP_S, STEADY_S, CHECKPOINT_S = 71, 77, 79


def _train_and_report_group_timeouts(argv: list[str], out_dir: str) -> None:
    import torch

    import runtime.checkpoint.saving as saving
    import runtime.commands.train as train_module
    import runtime.engine.loop as loop
    from compiler.torch_compat import group_timeout, process_groups
    from runtime.commands.train import check_inputs, train
    from runtime.device import configure_cpu_threads, select_device
    from runtime.distributed.process_group import LaunchEnv, init_distributed, shutdown_distributed

    env = LaunchEnv.from_environ()
    cfg, data, start = check_inputs(argv, env)
    device = select_device(env.local_rank, cfg.device)
    configure_cpu_threads(env.local_world_size)
    init_distributed(env, device, timeout_s=cfg.startup_timeout_s)
    seen: dict[str, list] = {"background": []}

    def record(when: str) -> None:
        seen[when] = {f"{g.group_name} {g.group_desc}": group_timeout(g, device).total_seconds() for g in process_groups()}

    def recording(when, fn):
        def wrapper(*args, **kwargs):
            record(when())
            return fn(*args, **kwargs)
        return wrapper

    steps = iter(range(1, 100))
    loop.train_step = recording(lambda: f"step {next(steps)}", loop.train_step)
    saving.begin_save = recording(lambda: "save", saving.begin_save)
    make_background = train_module.background_group

    def background_group(timeout_s):
        group = make_background(timeout_s)
        seen["background"].append(f"{group.group_name} {group.group_desc}")
        return group

    train_module.background_group = background_group
    train(cfg, data, start, env=env, device=device)
    record("after")
    with open(f"{out_dir}/rank{env.rank}.json", "w") as f:
        json.dump(seen, f)
    shutdown_distributed()
    del torch


def test_every_group_of_a_run_carries_its_phases_timeout(tmp_path):
    # HSDP (dp 4 sharded in pairs) x pp 2 with tied embeddings and background checkpoints: every kind of
    # group the engine makes.
    argv = ["--dp", "4", "--dp-shard", "2", "--pp", "2", "--model", "tiny", "--seq-len", "32", "--micro-batch-size", "1",
            "--steps", "2", "--eval-every", "0", "--precision", "fp32", "--data", "synthetic", "--peak-tflops", "1",
            "--device", "cpu", "--startup-timeout", str(STARTUP_S), "--collective-timeout", str(STEADY_S),
            "--checkpoint-timeout", str(CHECKPOINT_S), "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--async-checkpoint", "--logdir", str(tmp_path / "log")]
    spawn_ranks(_train_and_report_group_timeouts, world_size=8, args=(argv, str(tmp_path)), timeout=240)
    for rank in range(8):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        [background] = seen["background"]
        expected = {"step 1": STARTUP_S, "step 2": STEADY_S, "save": CHECKPOINT_S, "after": STEADY_S}
        for when, seconds in expected.items():
            groups = {name: s for name, s in seen[when].items() if name != background}
            # world, mesh dp / pp / mp, dp_replicate, dp_shard (the tied copies exchange point to point on
            # the pp group: no group of their own)
            assert len(groups) >= 6, (rank, when, seen[when])
            assert set(groups.values()) == {seconds}, (rank, when, seen[when])
        # made in start-up with the checkpoint timeout, and kept there whatever the training thread does
        assert seen["after"][background] == CHECKPOINT_S, (rank, seen["after"])
