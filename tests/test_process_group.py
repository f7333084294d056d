"""runtime/distributed/process_group.py: --collective-timeout reaches every process group a training run
creates: the world's, DeviceMesh's per-dimension groups, HSDP's unflattened (replicate, shard) groups, the
tied-embedding pairs and the background checkpoint group. Each is given the timeout where it is made
(torch's module defaults, which a group made without one takes, are 10 minutes for NCCL and 30 for gloo);
on gloo the test reads it back from every group's options, the same options DeviceMesh hands NCCL."""

from __future__ import annotations

import json

import pytest

from tests.launch import spawn_ranks

pytestmark = pytest.mark.slow  # a real 8-rank job

TIMEOUT_S = 77


def _train_and_report_group_timeouts(argv: list[str], out_dir: str) -> None:
    import torch

    from compiler.torch_compat import group_timeout, process_groups
    from runtime.commands.train import check_inputs, train
    from runtime.device import configure_cpu_threads, select_device
    from runtime.distributed.process_group import LaunchEnv, init_distributed, shutdown_distributed

    env = LaunchEnv.from_environ()
    cfg, data, start = check_inputs(argv, env)
    device = select_device(env.local_rank, cfg.device)
    configure_cpu_threads(env.local_world_size)
    init_distributed(env, device, timeout_s=cfg.collective_timeout_s)
    train(cfg, data, start, env=env, device=device)
    timeouts = {f"{group.group_name} {group.group_desc}": group_timeout(group, device).total_seconds()
                for group in process_groups()}
    with open(f"{out_dir}/rank{env.rank}.json", "w") as f:
        json.dump(timeouts, f)
    shutdown_distributed()


def test_every_group_of_a_run_carries_the_collective_timeout(tmp_path):
    # HSDP (dp 4 sharded in pairs) x pp 2 with tied embeddings and background checkpoints: every kind of
    # group the engine makes.
    argv = ["--dp", "4", "--dp-shard", "2", "--pp", "2", "--model", "tiny", "--seq-len", "32", "--micro-batch-size", "1",
            "--steps", "1", "--eval-every", "0", "--precision", "fp32", "--data", "synthetic", "--peak-tflops", "1",
            "--device", "cpu", "--collective-timeout", str(TIMEOUT_S), "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--async-checkpoint", "--logdir", str(tmp_path / "log")]
    spawn_ranks(_train_and_report_group_timeouts, world_size=8, args=(argv, str(tmp_path)), timeout=240)
    for rank in range(8):
        timeouts = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # world, mesh dp / pp / mp, dp_replicate, dp_shard, the background group (the tied copies
        # exchange point to point on the pp group: no group of their own)
        assert len(timeouts) >= 7, (rank, timeouts)
        assert all(seconds == TIMEOUT_S for seconds in timeouts.values()), (rank, timeouts)
