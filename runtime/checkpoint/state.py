"""Save and restore the whole training state with ``torch.distributed.checkpoint`` (DCP).

Every tensor is keyed by the *original model's* parameter name ("layers.3.attn.qkv.weight"), never by
stage or rank, and passed to DCP as the DTensor (or plain tensor) this rank holds. DCP records which
chunk of which global tensor each rank wrote, so a checkpoint saved on one (dp, pp, mp) mesh loads on
any other: each rank reads exactly the chunks its new shards cover.

    model.<name>                     parameters (DTensor shards under FSDP / TP)
    optim.<name>.exp_avg / .exp_avg_sq / .step
                                     AdamW state of each trained parameter, sharded exactly like it
    train_state                      JSON: step, data position, LR-schedule position, grad-scaler state,
                                     divergence-guard state, the run's config
    rng.rank<r>                      each rank's RNG state

Writing and publishing a checkpoint is runtime/checkpoint/saving.py. Failures on any rank are agreed on
by all ranks, so every rank raises the same CheckpointError at the same point.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.optim.lr_scheduler import LambdaLR

from compiler.parallelize.float8 import master_weight
from compiler.parallelize.stages import LocalStages
from compiler.torch_compat import lr_schedule_state, optimizer_step_dtype, restore_lr_schedule
from runtime.checkpoint.files import (
    CheckpointError,
    CheckpointInfo,
    dcp_index,
    read_dcp_metadata,
    verify_files,
)
from runtime.distributed.collectives import gather_lists
from runtime.engine.guards import DivergenceGuard


@dataclass
class TrainState:
    """The live objects a checkpoint captures and restores."""

    stages: LocalStages
    optimizer: torch.optim.Optimizer
    lr_schedule: LambdaLR
    scaler: torch.amp.GradScaler
    guard: DivergenceGuard
    config: dict  # TrainConfig.to_dict()
    params: list[tuple[str, nn.Parameter]] = field(init=False)

    def __post_init__(self) -> None:
        # Taken once, before any step: these are the (sharded) Parameter objects the optimizer holds.
        self.params = self.stages.named_parameters()


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's state now, exactly as its first step would (zeros, step 0).

    A checkpoint then always has optimizer state to save and a resumed run a place to load it into,
    even if no step has run (or fp16 skipped every step so far).
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                # As torch.optim.adam._init_group does: a fused (or capturable) step counter lives on the
                # parameter's device, where the fused kernel reads it.
                on_device = group.get("fused") or group.get("capturable")
                state["step"] = torch.zeros((), dtype=optimizer_step_dtype(is_fused=bool(group.get("fused"))),
                                            device=p.device if on_device else "cpu")
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def tensor_state(state: TrainState) -> dict:
    """Model and optimizer tensors by original parameter name; DCP reads into / writes from them in place."""
    model, optim = {}, {}
    for name, p in state.params:
        model[name] = master_weight(p.detach())  # --fp8-all-gather's weight shards: the fp32 tensor they wrap
        s = state.optimizer.state.get(p)  # none for a frozen parameter (LoRA's base, a router's selection bias)
        if s:
            optim[name] = {"exp_avg": s["exp_avg"], "exp_avg_sq": s["exp_avg_sq"], "step": s["step"]}
    return {"model": model, "optim": optim}


def train_state_json(state: TrainState, step: int) -> str:
    return json.dumps({
        "step": step,
        "data_position": step,  # batches are a pure function of (seed, step): the position is the step
        "lr_schedule": dict(zip(("last_epoch", "step_count"), lr_schedule_state(state.lr_schedule))),
        "scaler": state.scaler.state_dict(),
        "guard": state.guard.state_dict(),
        "config": state.config,
    })


def rng_state() -> torch.Tensor:
    return torch.get_rng_state()


# --- errors ----------------------------------------------------------------------------------------------

def failure_summary(e: BaseException) -> str:
    """One line per failed rank from DCP's CheckpointException (its str() is a set of tracebacks)."""
    if isinstance(e, CheckpointException):
        parts = []
        for rank, (exc, _trace) in sorted(e.failures.items()):
            parts.append(f"rank {rank}: {one_line(exc)}")
        return "; ".join(parts)
    return one_line(e)


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}" if not isinstance(exc, OSError) else str(exc)


# --- loading ----------------------------------------------------------------------------------------------

class _NamingReader(FileSystemReader):
    """A FileSystemReader whose read errors name the shard files this rank was reading."""

    def read_data(self, plan, planner):
        try:
            return super().read_data(plan, planner)
        except Exception as e:
            files = sorted({self.storage_data[item.storage_index].relative_path for item in plan.items})
            raise CheckpointError(f"cannot read {', '.join(str(Path(self.path) / f) for f in files)}: "
                                  f"{one_line(e)}") from e


def load_checkpoint(state: TrainState, info: CheckpointInfo) -> int:
    """Load ``info`` into the live state, resharding to this run's mesh; returns the step to continue from.

    ``info`` has passed ``checkpoint_files.read_checkpoint`` and ``check_same_model`` on every rank.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    # Content check first, spread over the ranks: never half-load a corrupted checkpoint.
    names = sorted(info.files)
    problems = gather_lists(verify_files(info, names[rank::world]))
    if problems:
        raise CheckpointError(problems[0])

    rng_ranks = (info.index or dcp_index(read_dcp_metadata(info.path)))["rng_ranks"]
    rng_key = f"rank{rank}" if rank < rng_ranks else "rank0"  # a rank the saving run did not have: rank 0's
    state_dict = {**tensor_state(state), "train_state": "", "rng": {rng_key: torch.empty_like(rng_state())}}
    try:
        dcp.load(state_dict, storage_reader=_NamingReader(info.path))
    except CheckpointException as e:
        raise CheckpointError(f"checkpoint {info.path} cannot be loaded: {failure_summary(e)}") from None
    saved = json.loads(state_dict["train_state"])
    _restore_lr_schedule(state.lr_schedule, saved["lr_schedule"])
    if state.scaler.is_enabled() and saved["scaler"]:
        state.scaler.load_state_dict(saved["scaler"])
    state.guard.load_state_dict(saved["guard"])
    torch.set_rng_state(state_dict["rng"][rng_key])
    return int(saved["step"])


def load_model_only(stages: LocalStages, info: CheckpointInfo) -> None:
    """The checkpoint's model weights alone (no optimizer, schedule or RNG), resharded onto ``stages``: what
    evaluating a checkpoint needs. ``info`` has passed ``read_checkpoint`` on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    names = sorted(info.files)
    problems = gather_lists(verify_files(info, names[rank::world]))
    if problems:
        raise CheckpointError(problems[0])
    state_dict = {"model": {name: master_weight(p.detach()) for name, p in stages.named_parameters()}}
    try:
        dcp.load(state_dict, storage_reader=_NamingReader(info.path))
    except CheckpointException as e:
        raise CheckpointError(f"checkpoint {info.path} cannot be loaded: {failure_summary(e)}") from None


def _restore_lr_schedule(schedule: LambdaLR, saved: dict) -> None:
    """Put the schedule at the saved position; the rate is recomputed from this run's flags with the same
    formula LambdaLR.get_lr uses, so an unchanged config continues bit for bit."""
    last_epoch = int(saved["last_epoch"])
    lrs = [base * fn(last_epoch) for base, fn in zip(schedule.base_lrs, schedule.lr_lambdas)]
    for group, lr in zip(schedule.optimizer.param_groups, lrs):
        group["lr"] = lr
    restore_lr_schedule(schedule, last_epoch=last_epoch, step_count=int(saved["step_count"]), last_lrs=lrs)


# --- agreement between ranks ------------------------------------------------------------------------------

def agree(fn, *, what: str) -> None:
    """Run ``fn`` on every rank; if it failed anywhere, raise the same CheckpointError everywhere."""
    try:
        fn()
        message = None
    except Exception as e:
        message = f"rank {dist.get_rank()} could not {what}: {one_line(e)}"
    messages = gather_lists([message] if message else [])
    if messages:
        raise CheckpointError(messages[0])
