"""Tied embedding copies on two pipeline ranks: their gradients are summed whether or not each copy got one,
over the pipeline group the ranks already share (no process group of their own)."""

from __future__ import annotations

import datetime
import json

import pytest
import torch
import torch.distributed as dist

from models.spec import TIED_EMBEDDINGS as TIED
from runtime.engine.tied import TiedWeights
from tests.fake_world import fake_world
from tests.launch import spawn_ranks

# (copy on pp rank 0 has a gradient, copy on pp rank 1 has one): a missing one used to leave the partner
# blocked in the pair's all-reduce until the collective timeout.
CASES = [(True, True), (False, True), (True, False), (False, False)]


def _exchange(out_dir: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))  # a hang fails within 20 s
    rank = dist.get_rank()
    name = "tok_emb.weight" if rank == 0 else "head.weight"  # the first stage's copy, the last stage's
    results = []
    for has_grad in CASES:
        weight = torch.nn.Parameter(torch.zeros(3, 2))
        own = torch.arange(6.0).view(3, 2) * (rank + 1) + 0.25
        weight.grad = own.clone() if has_grad[rank] else None
        tied = TiedWeights([(name, weight)], tied_weights=TIED, pp_group=dist.group.WORLD, pp_rank=rank, first_pp=0, last_pp=1)
        tied.sync_grads()
        results.append(weight.grad.tolist())
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_both_copies_get_the_sum_even_when_one_had_no_gradient(tmp_path):
    spawn_ranks(_exchange, world_size=2, args=(str(tmp_path),), timeout=120)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for i, has_grad in enumerate(CASES):
        want = sum(torch.arange(6.0).view(3, 2) * (r + 1) + 0.25 for r in range(2) if has_grad[r])
        want = want if isinstance(want, torch.Tensor) else torch.zeros(3, 2)
        for rank in range(2):
            assert torch.equal(torch.tensor(got[rank][i]), want), (has_grad, rank, got[rank][i])


def test_no_process_group_is_created_for_the_pairs(monkeypatch):
    """Rank 5 of 2x2x2 (dp 1, pp 0, mp 1) holds the embedding; its partner is pp rank 1 of its pipeline group.
    The pair groups used to cost dp x mp world-wide new_group calls on every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    with fake_world(rank=5, world_size=8):
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "pp", "mp"))
        calls = []
        monkeypatch.setattr(dist, "new_group", lambda *a, **k: calls.append(a) or pytest.fail("new_group called"))
        weight = torch.nn.Parameter(torch.zeros(2))
        tied = TiedWeights([("tok_emb.weight", weight)], tied_weights=TIED, pp_group=mesh["pp"].get_group(), pp_rank=0,
                           first_pp=0, last_pp=1)
        assert calls == []
        assert tied.peer == 1 and dist.get_global_rank(tied.group, tied.peer) == 7  # dp 1, pp 1, mp 1
        assert tied.copies == [weight]
