"""Saving through the engine's writer in one process (a one-rank gloo world): each file is hashed as it is
written, never read back, and the manifest's digests and index match the files; the cached stager
reuses its buffers and carries each save's own values."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
import torch.distributed as dist

import runtime.checkpoint.files as files_module
from compiler.parallelize.stages import LocalStages
from runtime.checkpoint.files import dcp_index, read_checkpoint, read_dcp_metadata
from runtime.checkpoint.saving import Checkpointer
from runtime.checkpoint.state import TrainState, init_optimizer_state
from runtime.engine.amp import build_grad_scaler
from runtime.engine.guards import DivergenceGuard
from runtime.engine.optim import build_lr_schedule, build_optimizer


@pytest.fixture
def one_rank_world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _state() -> TrainState:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16))
    optimizer = build_optimizer(list(module.parameters()), lr=1e-3, weight_decay=0.1)
    init_optimizer_state(optimizer)
    return TrainState(LocalStages([0], [module], [], 1), optimizer,
                      build_lr_schedule(optimizer, warmup_steps=1, total_steps=10), build_grad_scaler("fp32", "cpu"),
                      DivergenceGuard(5, 1.0, loss_scaling=False), config={"mesh": {"dp": 1, "pp": 1, "mp": 1}})


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_files_are_hashed_as_written_and_never_read_back(one_rank_world, tmp_path, monkeypatch, background):
    def no_reading(path):
        raise AssertionError(f"{path} was read back to hash it")

    monkeypatch.setattr(files_module, "file_sha256", no_reading)
    state = _state()
    checkpointer = Checkpointer(tmp_path, every=1, keep=1, state=state, verbose=False,
                                group=dist.group.WORLD if background else None)
    for step in (1, 2):
        with torch.no_grad():
            state.params[0][1].add_(1.0)  # each checkpoint holds other values
        checkpointer.save(step, wait=True)
    monkeypatch.undo()

    info = read_checkpoint(tmp_path / "step-000002")
    on_disk = sorted(p.name for p in info.path.iterdir() if p.name != "checkpoint.json")
    assert sorted(info.files) == on_disk and ".metadata" in on_disk
    for name, recorded in info.files.items():  # digests of the bytes as they are on disk
        data = (info.path / name).read_bytes()
        assert recorded == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    assert info.index == json.loads(json.dumps(dcp_index(read_dcp_metadata(info.path))))
    assert info.index["shapes"]["0.weight"] == [16, 8] and info.index["rng_ranks"] == 1


def test_a_file_written_out_of_order_gets_no_digest_and_is_hashed_from_disk(tmp_path):
    from runtime.checkpoint.writer import HashingFileSystem

    fs = HashingFileSystem()
    with fs.create_stream(tmp_path / "sequential", "wb") as f:
        f.write(b"abc")
        f.write(memoryview(b"def"))
    with fs.create_stream(tmp_path / "patched", "wb") as f:
        f.write(b"abcdef")
        f.seek(0)
        f.write(b"X")
    assert fs.digests == {"sequential": {"bytes": 6, "sha256": hashlib.sha256(b"abcdef").hexdigest()}}


def _stage_twice(stager) -> tuple[dict, dict, bool]:
    """Two saves of the same weights (as the engine's: the same parameters, updated in place), a new step's
    JSON and a new RNG state."""
    weights = torch.ones(3)
    first = stager.stage({"w": weights, "train_state": '{"step": 1}', "rng": {"rank0": torch.tensor([1, 2])}})
    buffer = first["w"].data_ptr()
    weights.fill_(2.0)
    second = stager.stage({"w": weights, "train_state": '{"step": 2}', "rng": {"rank0": torch.tensor([3, 4])}})
    assert second["w"].tolist() == [2.0, 2.0, 2.0] and second["train_state"] == '{"step": 2}'
    assert second["rng"]["rank0"].tolist() == [3, 4]
    weights.add_(1.0)  # training goes on: the staged copy is a snapshot
    assert second["w"].tolist() == [2.0, 2.0, 2.0]
    return first, second, second["w"].data_ptr() == buffer


def test_the_accelerator_stager_reuses_page_locked_buffers(monkeypatch):
    """Pinning needs an accelerator, so here it is the identity: what is checked is that the second save
    reuses the first one's buffers with the second save's values, strings included (the step's JSON)."""
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    from runtime.checkpoint.writer import build_stager

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    stager = build_stager(torch.device("cuda"))
    assert isinstance(stager, BlockingAsyncStager) and stager.cache_staged_state_dict
    *_, reused = _stage_twice(stager)
    assert reused


def test_the_cpu_stager_snapshots_each_save_without_pinning():
    from runtime.checkpoint.writer import build_stager

    *_, reused = _stage_twice(build_stager(torch.device("cpu")))
    if torch.torch_version.TorchVersion(torch.__version__) >= "2.13":
        assert reused  # DefaultStager keeps its buffers between saves from torch 2.13 (2.11 frees them)
