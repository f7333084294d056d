"""Every private torch API the engine touches, in one place (developers' guide: public APIs where possible, a
private one through one shim). Nothing else in models/, compiler/ or runtime/ imports a private torch module or
name (tests/test_architecture.py checks the imports; the attribute uses below are the rest).

The engine runs on torch 2.13 (here) and 2.11 (the GPU machines). Each entry was read in both versions'
sources (the 2.11.0 and 2.13.0 wheels) and exists in both with the same meaning unless noted;
tests/compiler/test_torch_compat.py checks every one on the installed version. Where they differ:

- Pipeline warm-up: 2.11's schedules exchange a dummy tensor with every neighbour stage's rank on the first
  step (``PipelineStage._get_init_p2p_neighbors_ops`` through ``_batch_p2p``); 2.13 runs a forward/backward
  vote between ``PipelineStage``s instead (``_PipelineSchedule._warmup_p2p``) and builds those ops only for
  other stage types, and adds ``_validate_stage_tensors`` and ``_send_meta``/``_recv_meta``.
- ``schedules._batch_p2p``: 2.11 always calls ``batch_isend_irecv``; 2.13 posts an all-send or all-receive
  batch op by op and coalesces only mixed batches. On NCCL ``batch_isend_irecv`` returns ONE coalesced
  work for the whole batch (``_coalescing_manager(...).works``); on gloo one work per op.
- ``_PipelineSchedule._compute_loss(output, target)`` gained ``loss_kwargs=None`` in 2.13.
- 2.11 checks every stage's outputs against the traced values' shapes and dtypes (2.13 only under
  ``TORCH_DISTRIBUTED_DEBUG=DETAIL``), so the graph's values must say what a stage really outputs (the
  vocabulary-parallel logits' local width, the message dtype); it marks integer receive buffers as
  requiring gradients (``stages_receive_integer_tensors``); its ``DeviceMesh._unflatten`` inverts its check
  of a dimension name (``unflatten_mesh`` passes the index); its ``DefaultStager`` closes itself after each
  ``stage`` and its ``FileSystemWriter.finish`` fills a copy of the metadata (runtime/checkpoint/writer.py).
"""

from __future__ import annotations

import contextlib
import datetime
import inspect

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as _funcol
import torch.distributed.distributed_c10d as _c10d
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.distributed.fsdp.sharded_grad_scaler import _GeneralMultiDeviceReplicator
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as _schedules
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.pipelining.schedules import _Action, _ComputationType, _PipelineScheduleRuntime
from torch.distributed.pipelining.stage import _PipelineStage
from torch.distributed.tensor import _api as _dtensor_api
from torch.distributed.tensor import _dispatch as _dtensor_dispatch
from torch.distributed.tensor import _redistribute as _dtensor_redistribute
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torch.export.unflatten import InterpreterModule
from torch.optim.optimizer import _get_scalar_dtype
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.checkpoint import _CachedTorchDispatchMode

__all__ = [
    "Action", "ComputationType", "PipelineScheduleRuntime", "FakeTensorMode", "FSDPParamGroup", "StridedShard",
    "MultiDeviceReplicator", "checkpoint_wrapper", "compute_local_shape_and_global_offset",
    "generate_stage_to_rank_mapping", "TorchDispatchMode", "RecomputeFromCacheEveryTime",
]

# --- pipelining: schedules as action lists, warm-up, generated code --------------------------------------

Action = _Action  # (stage index, computation type, micro-batch index)
ComputationType = _ComputationType  # FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, SEND_F, ...
PipelineScheduleRuntime = _PipelineScheduleRuntime  # runs any per-rank action list, inserting sends/receives


def set_pipeline_order(schedule: _PipelineScheduleRuntime, order: dict[int, list[_Action | None]]) -> None:
    """Give a ``PipelineScheduleRuntime`` its compute-only action list per rank; torch adds the communication
    (``_prepare_schedule_with_comms``, the same signature in 2.11 and 2.13)."""
    schedule.pipeline_order = order
    schedule._prepare_schedule_with_comms(order)


def skip_self_p2p_warmup(stage: PipelineStage) -> None:
    """Keep the first step's warm-up messages off the stage's own rank (a V placement holds neighbour stages
    p-1 and p on one rank; gloo cannot send to itself, "Pair is not connected"). The schedule hands
    activations to a same-rank stage locally, so the dropped messages carried nothing. torch 2.11 builds
    them for every stage; 2.13 only for non-``PipelineStage`` stages, so there this is inert."""
    build_ops = stage._get_init_p2p_neighbors_ops

    def ops_to_other_ranks():
        return [op for op in build_ops() if op.group_peer != stage.group_rank]

    stage._get_init_p2p_neighbors_ops = ops_to_other_ranks


def backward_whole_in_input_pass(stage: PipelineStage) -> None:
    """Under a split-backward schedule, let ``stage``'s input pass (I) compute its weights' gradients too and its
    weight pass (W) do nothing: the stage's ``dw_builder`` (a public ``PipelineStage`` argument; the
    traced ``_PipelineStage`` takes none, so it is set after building), with which ``backward_one_chunk`` runs the
    full backward (``stage_backward``: one ``autograd.backward``, parameter hooks firing as in 1F1B) and
    ``backward_weight_one_chunk`` calls what the builder returned. (Read in 2.13 and in an older release's sources,
    alike; 2.11's own were not at hand: tests/compiler/test_torch_compat.py checks it on the installed torch.)"""
    stage.dw_builder = lambda: _no_weight_pass


def _no_weight_pass() -> None:
    return None


def weight_pass_is_empty(stage: PipelineStage) -> bool:
    """Whether ``backward_whole_in_input_pass`` gave ``stage`` an empty weight pass."""
    return getattr(stage, "dw_builder", None) is not None and stage.dw_builder() is _no_weight_pass


def run_generated_code(stage_module: torch.nn.Module) -> None:
    """Run a traced stage's ``InterpreterModule``s as their generated Python ``forward`` instead of through
    ``fx.Interpreter`` node by node (``_run_with_interpreter``, torch/export/unflatten.py in both versions)."""
    for module in stage_module.modules():
        if isinstance(module, InterpreterModule):
            module._run_with_interpreter = False


# --- FP8 products (compiler/fp8/kernels.py probes what the device runs) ---------------------------------

def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, *,
              out_dtype: torch.dtype) -> torch.Tensor:
    """``torch._scaled_mm``: (M, K) x (K, N) FP8 with float32 dequantization scales -> (M, N) ``out_dtype``. The
    same schema in 2.11 and 2.13 (since pytorch PR 128683, 2.5: self, mat2, scale_a, scale_b, bias, scale_result,
    out_dtype, use_fast_accum; no amax output). Which scalings run depends on the build and device (2.13's CPU:
    tensorwise and rowwise; CUDA SM90: also 1x128 / 128x128 blocks from CUDA 12.9), so callers probe."""
    return torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype)


def scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      offsets: torch.Tensor, *, out_dtype: torch.dtype) -> torch.Tensor:
    """``torch._scaled_grouped_mm`` (2.11 and 2.13: self, mat2, scale_a, scale_b, offs, bias, scale_result,
    out_dtype, use_fast_accum): (M, K) x (E, K, N) with int32 cumulative row ``offsets`` -> (M, N). CUDA only (no
    CPU kernel in 2.13), rowwise scales (M,) and (E, N), bf16 output."""
    return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offsets, out_dtype=out_dtype)


def has_scaled_grouped_mm() -> bool:
    return hasattr(torch, "_scaled_grouped_mm")


@contextlib.contextmanager
def real_tensors():
    """A context in which new tensors are real even inside ``FakeTensorMode`` (a kernel probe must run on data) and
    no dispatch mode sees the ops: selective checkpointing's caching mode numbers a block's ``mm`` calls, and a probe
    first reached inside one would shift every later product's cached output in the recomputation, which probes
    nothing."""
    with unset_fake_temporarily(), _disable_current_modes():
        yield


# --- what the profiler wraps (runtime/observe/profiling.py) ----------------------------------------------

P2P_BATCH = (_schedules, "_batch_p2p")  # (p2p ops, desc=None) -> works: every schedule's send/receive
SCHEDULE_LOSS = "_compute_loss"  # a schedule's loss call: (output, target) on 2.11, (..., loss_kwargs) on 2.13
# DTensor's redistributions (Megatron's TP all-reduces): each module binds ``redistribute_local_tensor`` itself.
REDISTRIBUTE = tuple((module, "redistribute_local_tensor")
                     for module in (_dtensor_redistribute, _dtensor_dispatch, _dtensor_api))
FUNCTIONAL_WAIT = (_funcol, "wait_tensor")  # the deferred wait of a functional collective


# --- DTensor, FSDP, AMP, autograd internals --------------------------------------------------------------

StridedShard = _StridedShard  # FSDP's dim-0 shard of a TP-sharded parameter
MultiDeviceReplicator = _GeneralMultiDeviceReplicator  # ShardedGradScaler's per-device found-inf / inv-scale


def replicated_tensors(replicator: _GeneralMultiDeviceReplicator) -> dict[torch.device, torch.Tensor]:
    """The per-device copies a ``MultiDeviceReplicator`` made (what ``_unscale_grads_`` returns)."""
    return replicator._per_device_tensors


def foreach_norm(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return torch._foreach_norm(tensors)


def foreach_mul_(tensors: list[torch.Tensor], scalar: float) -> None:
    torch._foreach_mul_(tensors, scalar)


def non_finite_check_and_unscale_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def tensor_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of, if any."""
    return t._base


# A tensor subclass that wraps another (FSDP2's all-gather extensions, compiler/fp8/fsdp_all_gather.py): torch's
# wrapper-subclass constructor, its "no __torch_function__" default, and pytree's walks over op arguments (lists
# of tensors in the optimizer's foreach ops).
DISABLED_TORCH_FUNCTION = torch._C._disabled_torch_function_impl
tree_map_only = _pytree.tree_map_only
tree_leaves = _pytree.tree_leaves


def make_wrapper_subclass(cls: type, like: torch.Tensor, *, dtype: torch.dtype, requires_grad: bool) -> torch.Tensor:
    """An instance of ``cls`` with ``like``'s size, strides and device and no storage of its own."""
    return torch.Tensor._make_wrapper_subclass(cls, like.size(), strides=like.stride(), storage_offset=like.storage_offset(),
                                               dtype=dtype, layout=like.layout, device=like.device,
                                               requires_grad=requires_grad)


def dtensor_local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's own local tensor object (``to_local`` returns a fresh view of it): what FSDP2 calls the sharded
    parameter's local tensor and runs its all-gather extension hooks on (compiler/fp8/fsdp_all_gather.py)."""
    return t._local_tensor


# The CPU flash-attention kernels F.scaled_dot_product_attention runs on CPU (forward, backward).
CPU_FLASH_ATTENTION = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                       torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)


class RecomputeFromCacheEveryTime(_CachedTorchDispatchMode):
    """The recomputation mode of torch's selective checkpointing (``create_selective_checkpoint_contexts``'s
    second), made to serve its cached op outputs to every recomputation instead of the first only.

    torch marks a cache entry consumed when a recomputation reads it, so a second recomputation of the region
    raises "Trying to backward an extra time". The split-backward pipeline schedules (zero-bubble, zbv,
    dualpipev) recompute a checkpointed block twice: the input-gradient pass and the weight-gradient pass are
    two autograd graph tasks, and non-reentrant checkpointing recomputes once per graph task. Here the first
    recomputation snapshots the cache (filled by the forward) and each later one restores it. The storage is
    ``_CachedTorchDispatchMode.storage``: {op key: {call index: entry}} in 2.13; lists popped from the front in
    earlier releases, handled alike. The cached tensors live as long as the checkpoint's graph, as they do when
    the graph is kept for a second backward (``retain_graph``). A subclass of torch's mode, not a wrapper:
    torch.compile accepts only dispatch modes as the checkpoint's contexts."""

    def __init__(self, recompute: _CachedTorchDispatchMode) -> None:
        # 2.13 ignores the policy (the forward's mode tags each entry); earlier releases read it here.
        super().__init__(getattr(recompute, "policy_fn", None), recompute.storage, recompute.allow_cache_entry_mutation)
        self._snapshot: dict | None = None

    def __enter__(self):
        if self._snapshot is None:
            self._snapshot = {key: entries.copy() for key, entries in self.storage.items()}
        else:
            for key, entries in self._snapshot.items():
                if isinstance(entries, dict):
                    self.storage[key].update(entries)
                else:
                    self.storage[key][:] = entries
        return super().__enter__()


def raise_recompile_limit(extra: int) -> None:
    """Let dynamo compile ``extra`` more graphs per code object before it falls back to eager."""
    torch._dynamo.config.recompile_limit += extra


# --- optimizer and LR schedule state -----------------------------------------------------------------------

def optimizer_step_dtype(*, is_fused: bool = False) -> torch.dtype:
    """The dtype AdamW keeps its ``step`` counter in (fused kernels read a float32 one on the device)."""
    return _get_scalar_dtype(is_fused=is_fused)


def lr_schedule_state(schedule: torch.optim.lr_scheduler.LRScheduler) -> tuple[int, int]:
    """(last_epoch, step count): what a resumed LR schedule needs besides the learning rates."""
    return schedule.last_epoch, schedule._step_count


def restore_lr_schedule(schedule: torch.optim.lr_scheduler.LRScheduler, *, last_epoch: int, step_count: int,
                        last_lrs: list[float]) -> None:
    schedule.last_epoch, schedule._step_count, schedule._last_lr = last_epoch, step_count, last_lrs


# --- process groups and DeviceMesh -------------------------------------------------------------------------

def group_options(backend: str, timeout: datetime.timedelta) -> _C10dBackend.Options:
    """Options that make DeviceMesh create a dimension's groups with ``timeout``. DeviceMesh passes a
    timeout to ``split_group`` / ``new_group`` only as ``pg_options._timeout`` (``_init_one_process_group``
    in 2.11 and 2.13); without options NCCL groups get ``default_pg_nccl_timeout`` (10 min), gloo's 30 min.
    A fresh object per call: c10d writes each group's name and ranks into the options it is given."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False  # what c10d gives an NCCL group created without options
    else:
        options = _C10dBackend.Options(backend)
    options._timeout = timeout
    return options


def group_timeout(group: dist.ProcessGroup, device: torch.device) -> datetime.timedelta:
    """The timeout ``group``'s backend for ``device`` bounds every wait with."""
    return group._get_backend(device).options._timeout


def set_group_timeout(group: dist.ProcessGroup, timeout: datetime.timedelta) -> None:
    """Bound ``group``'s waits by ``timeout`` from its next operation on (``distributed_c10d._set_pg_timeout``,
    the same in 2.11 and 2.13: ``Backend::setTimeout`` on the group's gloo and NCCL backends). Gloo also
    updates its contexts, whose timeout bounds every send, receive and collective when it starts; NCCL copies
    the group's timeout into each work as it creates it (``work->opTimeout_ = options_->timeout``), which its
    watchdog checks; a work already in flight keeps the bound it started with. Timeouts are local: each rank
    sets its own. Checked on torch 2.11.0+cu130 on an H100: an NCCL subgroup's all-reduce posted after
    the switch carried the new timeout (``ProcessGroupNCCL._verify_work_timeout``), and a gloo all-reduce gave up
    at the new bound. Gloo's sends and receives do not follow it: ``bounded_p2p_works``."""
    _c10d._set_pg_timeout(timeout, group)


class _BoundedGlooWork:
    """A gloo point-to-point work whose wait is bounded by its group's timeout as it is now. Gloo fixes the
    bound of a send or receive waited on without one when the group connects (its transport context's
    timeout; ``Backend::setTimeout`` reaches only the collectives' ``gloo::Context``): without this a pipeline's
    receives would keep the start-up bound for the whole run. ``Work.wait(timeout)`` bounds that wait instead
    and fails the same way ("Timed out waiting 300000ms for recv operation"): seen on 2.13 here and 2.11 on the
    GPU machine, where a receive from a group created with 60 s, waited on with 2 s, gave up after 2.0 s."""

    def __init__(self, work: dist.Work, group: dist.ProcessGroup):
        self._work, self._group = work, group

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return self._work.wait(timeout or group_timeout(self._group, torch.device("cpu")))

    def __getattr__(self, name: str):
        return getattr(self._work, name)


def bounded_p2p_works(works: list[dist.Work], ops: list[dist.P2POp]) -> list:
    """``works`` of ``ops`` (``batch_isend_irecv``'s), each bounded by its group's current timeout where the group
    is gloo's (one work per operation there). NCCL's are returned as they are: each copied its group's timeout
    when it was created, and a timeout given to its wait would block the host."""
    if len(works) != len(ops):
        return works
    groups = [op.group or dist.group.WORLD for op in ops]
    return [_BoundedGlooWork(w, g) if dist.get_backend(g) == "gloo" else w for w, g in zip(works, groups)]


def bound_pipeline_p2p_waits() -> None:
    """Make every pipeline schedule's sends and receives (``schedules._batch_p2p(p2p_ops, desc)``, through which
    2.11's and 2.13's schedules post them all) waited on within their group's current timeout
    (``bounded_p2p_works``). Once per process; the profiler's wrapper (runtime/observe/profiling.py) goes around it."""
    if getattr(_schedules._batch_p2p, "_bounded", False):
        return
    batch_p2p = _schedules._batch_p2p

    def bounded(p2p_ops, desc=None):
        return bounded_p2p_works(batch_p2p(p2p_ops, desc), p2p_ops)

    bounded._bounded = True
    _schedules._batch_p2p = bounded


def process_groups() -> list[dist.ProcessGroup]:
    """Every process group this process has created (the world's first)."""
    return list(_c10d._world.pg_map)


def stages_receive_integer_tensors() -> bool:
    """Whether traced pipeline stages can receive integer tensors (packed documents' positions travel with the
    activations). 2.13's ``_PipelineStage._create_act_recv_info`` marks only floating receive buffers as
    requiring gradients; 2.11's marks every one, which raises "only Tensors of floating point dtype can
    require gradients" for an integer tensor at the first step."""
    return "is_floating_point" in inspect.getsource(_PipelineStage._create_act_recv_info)


def flatten_mesh(mesh: DeviceMesh, name: str, *, backend_override: _C10dBackend.Options) -> DeviceMesh:
    """The dimensions of ``mesh`` (a slice of a mesh, its dimensions not necessarily adjacent) as one
    dimension ``name`` (``DeviceMesh._flatten``, in 2.11 and 2.13), its group created with ``backend_override``."""
    return mesh._flatten(name, backend_override=backend_override)


def unflatten_mesh(mesh: DeviceMesh, dim: str, sizes: tuple[int, ...], names: tuple[str, ...],
                   backend_override: dict[str, _C10dBackend.Options]) -> DeviceMesh:
    """Split mesh dimension ``dim`` into ``names`` of ``sizes`` (``DeviceMesh._unflatten``, the same
    signature in 2.11 and 2.13), its new groups created with ``backend_override``'s options. The dimension
    goes by index: 2.11's ``_unflatten`` inverts its check of a name (it raises "dim dp specified in
    `_unflatten` is not in ('dp', 'pp', 'mp')" exactly when the name is there)."""
    return mesh._unflatten(mesh.mesh_dim_names.index(dim), sizes, names, backend_override=backend_override)



# --- expert parallelism -----------------------------------------------------------------------------------

# (input, output_split_sizes, input_split_sizes, group) -> output: the uneven all-to-all with autograd (its
# backward is the reverse all-to-all); in _functional_collectives of 2.11 and 2.13 alike.
all_to_all_single_autograd = _funcol.all_to_all_single_autograd


# --- context parallelism ----------------------------------------------------------------------------------

def cpu_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU flash-attention kernel (the one F.scaled_dot_product_attention runs on the CPU), with its
    log-sum-exp: q (B, H, Lq, hd), k and v (B, Hkv, Lk, hd), Hkv dividing H (grouped heads shared) ->
    (out (B, H, Lq, hd), lse (B, H, Lq) fp32). Causality is aligned top-left (query i sees keys j <= i)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal)


def cpu_flash_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 out: torch.Tensor, lse: torch.Tensor, *,
                                 is_causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Its backward given the output and log-sum-exp of the softmax the gradient is taken through (d q, d k, d v)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, is_causal)
