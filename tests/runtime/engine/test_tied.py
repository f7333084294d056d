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


MTP_TIED = {**TIED, "mtp.embed.weight": "tok_emb.weight"}  # models.tied_weights of a tied model with MTP depths


def _three_copies(out_dir: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    # pp rank 0: the embedding; pp rank 1: the head and the MTP depths' embedding, two Parameters of one weight
    names = ["tok_emb.weight"] if rank == 0 else ["head.weight", "mtp.embed.weight"]
    params = [torch.nn.Parameter(torch.zeros(3, 2)) for _ in names]
    for i, p in enumerate(params):
        p.grad = torch.full((3, 2), 10.0 ** (rank + i))  # 1 on rank 0; 10 and 100 on rank 1
    tied = TiedWeights(list(zip(names, params)), tied_weights=MTP_TIED, pp_group=dist.group.WORLD, pp_rank=rank,
                       first_pp=0, last_pp=1)
    tied.sync_grads()
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump({"grads": [p.grad.tolist() for p in params], "duplicates": len(tied.duplicates)}, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_the_last_stage_sums_its_two_copies_before_the_exchange(tmp_path):
    spawn_ranks(_three_copies, world_size=2, args=(str(tmp_path),), timeout=120)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(g == torch.full((3, 2), 111.0).tolist() for r in range(2) for g in got[r]["grads"])
    assert (got[0]["duplicates"], got[1]["duplicates"]) == (0, 2)  # the norm counts the embedding's copy only


def test_copies_on_one_rank_are_summed_and_a_shared_parameter_is_left_alone():
    """A V placement's rank 0 holds the first and last stages: three copies, summed there, two of them duplicates.
    One pipeline stage shares one Parameter under all three names: nothing to sum."""
    names = ("tok_emb.weight", "head.weight", "mtp.embed.weight")
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in names]
    for i, p in enumerate(params):
        p.grad = torch.full((2,), 10.0 ** i)
    tied = TiedWeights(list(zip(names, params)), tied_weights=MTP_TIED, pp_group=None, pp_rank=0, first_pp=0,
                       last_pp=0)
    tied.sync_grads()
    assert all(torch.equal(p.grad, torch.full((2,), 111.0)) for p in params)
    assert tied.duplicates == {id(params[1]), id(params[2])}
    shared = torch.nn.Parameter(torch.zeros(2))
    alone = TiedWeights([(n, shared) for n in names], tied_weights=MTP_TIED, pp_group=None, pp_rank=0, first_pp=0,
                        last_pp=0)
    assert alone.copies == [] and alone.duplicates == set()
