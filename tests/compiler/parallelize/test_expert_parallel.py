"""Token dispatch for expert parallelism (compiler/parallelize/expert_parallel.py) against computing every
expert on every rank: outputs, input gradients and the experts' weight gradients; the regrouping permutation
against a direct construction. Model-level parity with one process: tests/launches/test_parity.py."""

from __future__ import annotations

import datetime

import pytest
import torch

from compiler.parallelize.expert_parallel import expert_major_order
from tests.launch import spawn_ranks


def test_expert_major_order_groups_rows_by_expert_keeping_source_order():
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])  # 2 sources x 3 local experts
    # source-major rows: s0e0 s0e0 s0e2 | s1e0 s1e1 s1e1 s1e1 -> labelled by (source, expert, index)
    labels = [(s, e, i) for s in range(2) for e in range(3) for i in range(int(counts[s, e]))]
    order = expert_major_order(counts).tolist()
    assert [labels[i] for i in order] == sorted(labels, key=lambda t: (t[1], t[0], t[2]))
    assert expert_major_order(torch.zeros(2, 2, dtype=torch.long)).numel() == 0


def _grouped(x: torch.Tensor, counts: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Rows sorted by expert, expert e's rows times w[e] (E, D, D): the loop the model runs on CPU."""
    return torch.cat([rows @ w[e] for e, rows in enumerate(torch.split(x, counts.tolist()))])


def _dispatch_matches_local_compute(experts: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from compiler.parallelize.expert_parallel import dispatch_to_experts

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    dim, local = 4, experts // world
    weights = torch.randn(experts, dim, dim, generator=torch.Generator().manual_seed(0))  # the same everywhere
    gen = torch.Generator().manual_seed(1 + rank)  # each rank routes its own tokens
    choice = torch.randint(0, experts, (5 + 3 * rank,), generator=gen)
    choice[0] = rank * local  # some rows stay on their own rank; an expert may get none anywhere
    choice = choice.sort().values
    counts = torch.zeros(experts, dtype=torch.long).scatter_add_(0, choice, torch.ones_like(choice))
    x = torch.randn(choice.numel(), dim, generator=gen, requires_grad=True)

    mine = weights[rank * local:(rank + 1) * local].clone().requires_grad_(True)
    got = dispatch_to_experts(x, counts, group=mesh.get_group(), compute=lambda rows, c: _grouped(rows, c, mine))
    whole = weights.clone().requires_grad_(True)
    want = _grouped(x, counts, whole)
    torch.testing.assert_close(got, want)
    upstream = torch.randn(want.shape, generator=gen)
    (got_grad,) = torch.autograd.grad(got, x, upstream, retain_graph=True)
    want_grad, want_w = torch.autograd.grad(want, (x, whole), upstream)
    torch.testing.assert_close(got_grad, want_grad)
    (mine_grad,) = torch.autograd.grad(got, mine, upstream)
    dist.all_reduce(want_w)  # every rank's tokens contribute to every expert's gradient
    torch.testing.assert_close(mine_grad, want_w[rank * local:(rank + 1) * local])
    dist.destroy_process_group()


@pytest.mark.slow
def test_dispatch_to_expert_ranks_equals_every_rank_computing_every_expert():
    spawn_ranks(_dispatch_matches_local_compute, world_size=4, args=(8,), timeout=120)
