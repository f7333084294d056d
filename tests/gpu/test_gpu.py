"""The engine on a CUDA device (``pytest -m gpu``): one-rank training in bf16 and fp16 against the CPU fp32
reference, --compile, background checkpoints, MFU against the datasheet peak, the profiler's time split
against torch.profiler's CUDA view, the one-line errors for more ranks than GPUs and for ranks shown the same GPU,
and each phase's timeout reaching NCCL.

Skipped where torch.cuda.is_available() is False (tests/conftest.py), so CI on the CPU is unchanged. Written
for the machines this project borrows (one H100 or H200, torch 2.11.0+cu130): all ten passed on an H200 on 2026-11-26.
Each run happens in a fresh spawned process (a world of one, NCCL) and leaves its summary.json behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runtime.commands.flags import parse_train_config
from tests.launch import check_clean_failure, spawn_ranks, torchrun
from tests.reference import train_reference

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

TINY = ["--model", "tiny", "--micro-batch-size", "4", "--eval-every", "0", "--log-every", "1", "--peak-tflops", "1"]
TIMEOUT_S = 123


def _train_in_order(argvs: list[list[str]], out_dir: str) -> None:
    """One spawned rank: join the world once, train every argv in turn the way run.py does, and record each
    process group's timeout."""
    from compiler.torch_compat import group_timeout, process_groups
    from runtime.commands.train import check_inputs, train
    from runtime.device import select_device
    from runtime.distributed.process_group import LaunchEnv, init_distributed, shutdown_distributed

    env = LaunchEnv.from_environ()
    cfg, _, _ = check_inputs(argvs[0], env)
    device = select_device(env.local_rank, cfg.device)
    init_distributed(env, device, timeout_s=cfg.collective_timeout_s)
    for argv in argvs:
        cfg, data, start = check_inputs(argv, env)
        train(cfg, data, start, env=env, device=device)
    timeouts = [group_timeout(g, device).total_seconds() for g in process_groups()]
    Path(out_dir, "timeouts.json").write_text(json.dumps(timeouts))
    shutdown_distributed()


def _run(tmp_path: Path, *argvs: list[str], timeout: float = 600) -> list[dict]:
    """Train ``argvs`` (each given its own --logdir) on the GPU; their summaries."""
    logdirs = [tmp_path / f"run{i}" for i in range(len(argvs))]
    argvs = [[*argv, "--device", "cuda", "--logdir", str(logdir)] for argv, logdir in zip(argvs, logdirs)]
    spawn_ranks(_train_in_order, world_size=1, args=(argvs, str(tmp_path)), timeout=timeout)
    return [json.loads((logdir / "summary.json").read_text()) for logdir in logdirs]


@pytest.mark.parametrize("precision, tolerance", [("bf16", 0.05), ("fp16", 0.1)])
def test_one_rank_trains_like_the_cpu_fp32_reference(tmp_path, precision, tolerance):
    flags = [*TINY, "--steps", "6", "--collective-timeout", str(TIMEOUT_S)]
    (summary,) = _run(tmp_path, [*flags, "--precision", precision])
    reference = train_reference(parse_train_config([*flags, "--precision", "fp32", "--device", "cpu"], world_size=1),
                                steps=6)
    assert "cuda" in summary["device"].lower() or "nvidia" in summary["device"].lower(), summary["device"]
    assert summary["losses"][0] == pytest.approx(reference.losses[0], abs=tolerance / 2)  # before any update
    # Rounding differs step by step; fp16 may skip a step while its loss scale settles.
    assert summary["skipped_steps"] <= (2 if precision == "fp16" else 0)
    for step, (gpu, cpu) in enumerate(zip(summary["losses"], reference.losses)):
        assert abs(gpu - cpu) < tolerance, (step, summary["losses"], reference.losses)
    # --collective-timeout reached every NCCL group (NCCL's own default is 10 minutes).
    assert set(json.loads((tmp_path / "timeouts.json").read_text())) == {TIMEOUT_S}


def test_bf16_is_the_default_where_the_gpu_has_bf16_tensor_cores():
    major, _ = torch.cuda.get_device_capability()
    assert parse_train_config(TINY, world_size=1).precision == ("bf16" if major >= 8 else "fp32")


def test_compiled_blocks_train_like_eager_ones(tmp_path):
    flags = [*TINY, "--steps", "4", "--precision", "bf16"]
    eager, compiled = _run(tmp_path, flags, [*flags, "--compile"])
    assert compiled["losses"] == pytest.approx(eager["losses"], abs=0.02)


def test_background_checkpoints_resume_exactly_on_the_gpu(tmp_path):
    flags = [*TINY, "--steps", "6", "--precision", "fp32", "--checkpoint-every", "2", "--async-checkpoint"]
    whole, first, rest = _run(tmp_path, [*flags, "--checkpoint-dir", str(tmp_path / "a")],
                              [*flags, "--checkpoint-dir", str(tmp_path / "b"), "--stop-at-step", "4"],
                              [*flags, "--checkpoint-dir", str(tmp_path / "b"), "--resume"])
    assert whole["checkpoints"] and first["checkpoints"]
    assert (tmp_path / "b" / "latest").read_text().strip() == "step-000006"
    assert first["losses"] == pytest.approx(whole["losses"][:4], abs=1e-4)
    assert rest["losses"] == pytest.approx(whole["losses"][4:], abs=1e-3)


def test_mfu_is_taken_against_the_datasheet_peak(tmp_path):
    from runtime.observe.peak_flops import datasheet_peak, measure_device_matmul_flops

    flags = ["--model", "small", "--seq-len", "512", "--micro-batch-size", "8", "--steps", "8", "--eval-every", "0",
             "--precision", "bf16", "--data", "synthetic", "--log-every", "4"]
    (summary,) = _run(tmp_path, flags)
    row = datasheet_peak(torch.cuda.get_device_name())
    if row is None:
        assert summary["peak_flops_source"].startswith("measured:")
    else:
        assert summary["peak_flops"] == pytest.approx(row.bf16 * 1e12)
        assert summary["peak_flops_source"].startswith(f"datasheet: {row.model} dense bf16")
        # The measured fallback lands below, and not far below, the datasheet.
        measured = measure_device_matmul_flops(torch.bfloat16, torch.device("cuda"))
        assert 0.3 * row.bf16 * 1e12 < measured < 1.05 * row.bf16 * 1e12
    assert 0.02 < summary["mfu"] < 0.8, summary["mfu"]


def test_peak_device_memory_is_the_memory_models_prediction(tmp_path):
    """max_memory_allocated against the planner's memory model (what train's preflight and plan price), at a
    batch where the logits' fp32 loss temporaries are a large share (H200: 10.11 GiB measured, 10.0 predicted
    at --micro-batch-size 8 --seq-len 1024)."""
    flags = ["--model", "small", "--seq-len", "512", "--micro-batch-size", "8", "--microbatches", "2", "--steps", "3",
             "--eval-every", "0", "--precision", "bf16", "--data", "synthetic", "--peak-tflops", "1"]
    (summary,) = _run(tmp_path, flags)
    assert summary["peak_bytes"] == pytest.approx(summary["predicted_peak_tensor_bytes"], rel=0.1)
    assert summary["peak_reserved_bytes_per_rank"][0] >= summary["peak_bytes"]


def _profile_against_torch_profiler(argv: list[str], out_dir: str) -> None:
    """Profile a run with the engine's profiler and, over exactly its profiled steps, torch.profiler's CUDA
    activity: the kernels' device time per step."""
    from torch.profiler import ProfilerActivity, profile

    from runtime.commands.train import check_inputs, train
    from runtime.device import select_device
    from runtime.distributed.process_group import LaunchEnv, init_distributed, shutdown_distributed
    from runtime.observe.profiling import Profiler

    kernel_seconds, active = [], {}
    begin, end = Profiler.begin, Profiler.end

    def begin_both(self):
        begin(self)
        active["torch"] = profile(activities=[ProfilerActivity.CUDA])
        active["torch"].__enter__()

    def end_both(self):
        torch.cuda.synchronize()
        active["torch"].__exit__(None, None, None)
        end(self)
        kernel_seconds.append(sum(e.self_device_time_total for e in active["torch"].key_averages()) / 1e6)

    Profiler.begin, Profiler.end = begin_both, end_both
    env = LaunchEnv.from_environ()
    cfg, data, start = check_inputs(argv, env)
    device = select_device(env.local_rank, cfg.device)
    init_distributed(env, device)
    summary = train(cfg, data, start, env=env, device=device)
    Path(out_dir, "result.json").write_text(json.dumps({"kernel_seconds": kernel_seconds,
                                                        "split": summary["profile"]["per_rank"][0]}))
    shutdown_distributed()


def test_the_profilers_time_split_holds_the_gpus_kernel_time(tmp_path):
    argv = ["--model", "small", "--seq-len", "512", "--micro-batch-size", "4", "--steps", "5", "--eval-every", "0",
            "--precision", "bf16", "--data", "synthetic", "--peak-tflops", "1", "--profile", "--device", "cuda",
            "--logdir", str(tmp_path / "log")]
    spawn_ranks(_profile_against_torch_profiler, world_size=1, args=(argv, str(tmp_path)), timeout=600)
    result = json.loads((tmp_path / "result.json").read_text())
    kernels = sum(result["kernel_seconds"]) / len(result["kernel_seconds"])  # mean per profiled step
    split = result["split"]
    assert kernels > 0
    # Spans synchronise the stream, so the step holds its kernels, and forward, backward and the optimizer
    # hold most of them (host clocks alone would time launches and leave the kernels to whoever waits last).
    assert split["step_time"] >= 0.95 * kernels
    assert split["forward"] + split["backward"] + split["optimizer"] >= 0.8 * kernels, (split, kernels)
    assert split["forward"] + split["backward"] >= 0.5 * kernels, (split, kernels)
    assert split["idle"] < 0.05 * split["step_time"]  # one rank waits for no neighbour


def test_more_ranks_than_gpus_is_one_line_and_exit_2(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpus = torch.cuda.device_count()
    ranks = gpus + 1
    check_clean_failure(ranks, [*TINY, "--steps", "1", "--dp", str(ranks), "--device", "cuda"],
                        [f"{ranks} ranks on this node but each process sees {gpus} cuda device", "--device cpu",
                         f"--nproc_per_node={gpus}"])


def test_ranks_shown_the_same_gpu_are_refused_by_nccl_in_one_line_and_exit_2(monkeypatch):
    # CUDA_VISIBLE_DEVICES set alike for every process (not per process, as srun --gpus-per-task=1 sets it):
    # each sees one device and takes it, and NCCL finds two ranks on one GPU when the world's group starts.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    check_clean_failure(2, [*TINY, "--steps", "1", "--dp", "2", "--device", "cuda"],
                        ["--device cuda: ranks 0 and 1 are on the same GPU", "CUDA_VISIBLE_DEVICES=0",
                         "CUDA_VISIBLE_DEVICES per process"], max_seconds=90)


def _switch_nccl_timeouts(out_dir: str) -> None:
    """A world of one on NCCL: each phase's timeout reaches the group's backend and the works it creates."""
    import datetime

    import torch.distributed as dist

    from compiler.torch_compat import group_timeout
    from runtime.device import select_device
    from runtime.distributed.process_group import LaunchEnv, init_distributed, shutdown_distributed
    from runtime.distributed.timeouts import CHECKPOINT, STEADY, PhaseTimeouts, Timeouts

    env = LaunchEnv.from_environ()
    device = select_device(env.local_rank, "cuda")
    init_distributed(env, device, timeout_s=5)
    world = dist.group.WORLD
    backend = world._get_backend(device)
    phases = PhaseTimeouts(Timeouts(startup_s=41, steady_s=7, checkpoint_s=93))
    seen = {}
    for phase in (STEADY, CHECKPOINT):
        phases.switch(phase)
        work = dist.all_reduce(torch.ones(4, device=device), async_op=True)
        timeout = datetime.timedelta(seconds=phases.timeouts.of(phase))
        seen[phase.name] = {"group": group_timeout(world, device).total_seconds(),
                            "backend": type(backend).__name__,
                            # ProcessGroupNCCL's test hook, where this torch has it: the timeout the work got
                            "work": backend._verify_work_timeout(work, timeout)
                            if hasattr(backend, "_verify_work_timeout") else None}
        work.wait()
    Path(out_dir, "nccl_timeouts.json").write_text(json.dumps(seen))
    shutdown_distributed()


def test_each_phase_sets_the_nccl_groups_timeout(tmp_path):
    spawn_ranks(_switch_nccl_timeouts, world_size=1, args=(str(tmp_path),), timeout=120)
    seen = json.loads((tmp_path / "nccl_timeouts.json").read_text())
    assert seen["steady steps"]["backend"] == "ProcessGroupNCCL"
    assert (seen["steady steps"]["group"], seen["checkpoint I/O"]["group"]) == (7, 93)
    assert all(phase["work"] in (True, None) for phase in seen.values()), seen


def test_device_cpu_runs_gloo_on_a_gpu_machine(tmp_path):
    gpus = torch.cuda.device_count()
    result = torchrun([*TINY, "--steps", "2", "--dp", str(gpus + 1), "--device", "cpu", "--precision", "fp32",
                       "--logdir", str(tmp_path / "log")], nproc=gpus + 1, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "log" / "summary.json").read_text())
    assert "cuda" not in summary["device"].lower() and summary["config"]["device"] == "cpu"
