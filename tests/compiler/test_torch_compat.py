"""compiler/torch_compat.py on the installed torch: every private API the engine reaches through the shim
exists and does what the engine relies on (torch 2.11's sources were read for the same; see the module)."""

from __future__ import annotations

import datetime
import inspect
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble, schedules
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

from compiler import torch_compat as compat


def test_action_lists_run_on_torchs_pipeline_runtime():
    action = compat.Action(3, compat.ComputationType.FULL_BACKWARD, 1)
    assert (action.stage_index, action.computation_type, action.microbatch_index) == (3, compat.ComputationType.FULL_BACKWARD, 1)
    assert issubclass(compat.PipelineScheduleRuntime, PipelineScheduleMulti)
    assert "actions" in inspect.signature(compat.PipelineScheduleRuntime._prepare_schedule_with_comms).parameters
    assert compat.generate_stage_to_rank_mapping(2, 4, style="v") == {0: 0, 1: 1, 2: 1, 3: 0}


def test_self_warmup_messages_are_dropped_and_the_others_kept():
    ops = [SimpleNamespace(group_peer=0), SimpleNamespace(group_peer=1), SimpleNamespace(group_peer=0)]
    stage = SimpleNamespace(group_rank=0, _get_init_p2p_neighbors_ops=lambda: ops)
    compat.skip_self_p2p_warmup(stage)
    assert stage._get_init_p2p_neighbors_ops() == [ops[1]]


def test_traced_stages_run_their_generated_code():
    from torch.distributed.pipelining import SplitPoint, pipeline

    class TwoLayers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])

        def forward(self, x):
            return self.layers[1](torch.relu(self.layers[0](x)))

    pipe = pipeline(TwoLayers(), mb_args=(torch.zeros(2, 8),), split_spec={"layers.1": SplitPoint.BEGINNING})
    stage = pipe.get_stage_module(0)
    interpreted = [m for m in stage.modules() if hasattr(m, "_run_with_interpreter")]
    assert interpreted and all(m._run_with_interpreter for m in interpreted)  # torch's default
    compat.run_generated_code(stage)
    assert not any(m._run_with_interpreter for m in interpreted)
    assert stage(torch.ones(2, 8)).shape == (2, 8)


def test_the_profilers_hook_points_exist():
    owner, name = compat.P2P_BATCH
    assert list(inspect.signature(getattr(owner, name)).parameters)[:2] == ["p2p_ops", "desc"]
    owner, name = compat.FUNCTIONAL_WAIT
    assert callable(getattr(owner, name))
    assert all(callable(getattr(module, name)) for module, name in compat.REDISTRIBUTE)
    assert callable(getattr(compat.PipelineScheduleRuntime, compat.SCHEDULE_LOSS))
    assert all(callable(getattr(compat.FSDPParamGroup, name)) for name in ("unshard", "wait_for_unshard", "post_backward"))


def test_group_options_carry_the_timeout_for_each_backend():
    timeout = datetime.timedelta(seconds=42)
    assert compat.group_options("gloo", timeout)._timeout == timeout
    first, second = compat.group_options("gloo", timeout), compat.group_options("gloo", timeout)
    assert first is not second  # c10d writes each group's name and ranks into its options
    if dist.is_nccl_available():
        nccl = compat.group_options("nccl", timeout)
        assert isinstance(nccl, dist.ProcessGroupNCCL.Options) and nccl._timeout == timeout


def test_a_live_groups_timeout_can_be_changed():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=11))
        compat.set_group_timeout(group, datetime.timedelta(seconds=12.5))
        assert compat.group_timeout(group, torch.device("cpu")) == datetime.timedelta(seconds=12.5)
        dist.all_reduce(torch.ones(2), group=group)  # and it still works
    finally:
        dist.destroy_process_group()


def test_gloo_sends_and_receives_are_waited_on_within_their_groups_timeout_now():
    class Work:
        def wait(self, timeout=None):
            self.timeout = timeout
            return True

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=600))
        ops = [dist.P2POp(dist.irecv, torch.zeros(1), group=group, group_peer=0)]
        works = [Work()]
        (bounded,) = compat.bounded_p2p_works(works, ops)
        compat.set_group_timeout(group, datetime.timedelta(seconds=3))  # a phase switch after posting
        assert bounded.wait() and works[0].timeout == datetime.timedelta(seconds=3)
        assert compat.bounded_p2p_works(works, ops * 2) is works  # coalesced (NCCL): left as they are
        compat.bound_pipeline_p2p_waits()
        installed = schedules._batch_p2p
        compat.bound_pipeline_p2p_waits()
        assert schedules._batch_p2p is installed and installed([], None) == []  # once per process
    finally:
        dist.destroy_process_group()


def test_lr_schedule_state_round_trips():
    params = [torch.nn.Parameter(torch.zeros(2))]
    schedule = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(params, lr=1.0), lambda step: 0.5 ** step)
    for _ in range(3):
        schedule.optimizer.step()
        schedule.step()
    fresh = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(params, lr=1.0), lambda step: 0.5 ** step)
    last_epoch, step_count = compat.lr_schedule_state(schedule)
    compat.restore_lr_schedule(fresh, last_epoch=last_epoch, step_count=step_count, last_lrs=schedule.get_last_lr())
    assert compat.lr_schedule_state(fresh) == (3, 4) and fresh.get_last_lr() == [0.125]


def test_autograd_and_amp_internals():
    grads = [torch.tensor([3.0, 4.0]), torch.tensor([float("inf")])]
    assert [float(n) for n in compat.foreach_norm(grads[:1])] == [5.0]
    compat.foreach_mul_(grads[:1], 2.0)
    assert grads[0].tolist() == [6.0, 8.0]
    found_inf = compat.MultiDeviceReplicator(torch.zeros(()))
    inv_scale = compat.MultiDeviceReplicator(torch.full((), 0.5))
    compat.non_finite_check_and_unscale_(grads, found_inf.get(torch.device("cpu")), inv_scale.get(torch.device("cpu")))
    assert grads[0].tolist() == [3.0, 4.0] and float(compat.replicated_tensors(found_inf)[torch.device("cpu")]) == 1.0
    base = torch.zeros(4)
    assert compat.tensor_base(base[1:]) is base and compat.tensor_base(base) is None
    assert compat.optimizer_step_dtype() == torch.float32
    assert all(isinstance(op, torch._ops.OpOverloadPacket) for op in compat.CPU_FLASH_ATTENTION)


def test_recompile_limit_rises(monkeypatch):
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)
    compat.raise_recompile_limit(5)
    assert torch._dynamo.config.recompile_limit == 13


def test_fsdp_over_tp_placement_is_a_sharded_placement():
    # Neither 2.11's nor 2.13's _StridedShard subclasses Shard: the gradient norm checks for both.
    placement = compat.StridedShard(0, split_factor=2)
    assert (placement.dim, placement.split_factor) == (0, 2) and not isinstance(placement, torch.distributed.tensor.Shard)


def _zbv_gradients(*, whole_last_backward: bool) -> tuple[list[torch.Tensor], list[bool]]:
    """Two linear stages on a one-rank V placement under ZBV, 2 micro-batches: every weight's gradient, and for
    each weight pass (W) of the last stage whether it changed that stage's weight gradient."""
    torch.manual_seed(0)
    first, last = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    x = torch.randn(4, 4)
    stages = [PipelineStage(first, 0, 2, torch.device("cpu")), PipelineStage(last, 1, 2, torch.device("cpu"))]
    if whole_last_backward:
        compat.backward_whole_in_input_pass(stages[1])
    changed: list[bool] = []
    weight_pass = stages[1].backward_weight_one_chunk

    def recorded(*args, **kwargs):
        before = None if last.weight.grad is None else last.weight.grad.clone()
        weight_pass(*args, **kwargs)
        changed.append(before is None or not torch.equal(before, last.weight.grad))

    stages[1].backward_weight_one_chunk = recorded
    schedule = ScheduleZBVZeroBubble(stages, n_microbatches=2, loss_fn=lambda out, target: out.square().mean())
    schedule.step(x, target=torch.zeros(4, 1))
    return [p.grad.clone() for p in (first.weight, first.bias, last.weight, last.bias)], changed


def test_a_stage_can_run_its_whole_backward_in_its_input_pass():
    """The last stage's weight passes change nothing, the gradients equal the split backward's (its input passes
    computed the weights' share, once), and only that stage reports an empty weight pass."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        split, split_changed = _zbv_gradients(whole_last_backward=False)
        whole, whole_changed = _zbv_gradients(whole_last_backward=True)
    finally:
        dist.destroy_process_group()
    assert split_changed == [True, True] and whole_changed == [False, False]
    for got, want in zip(whole, split):
        torch.testing.assert_close(got, want)
    stage = SimpleNamespace(dw_builder=None)
    assert not compat.weight_pass_is_empty(stage)
    compat.backward_whole_in_input_pass(stage)
    assert compat.weight_pass_is_empty(stage)
