"""Multi-head latent attention under context parallelism (compiler/parallelize/latent_gather.py), both ways: the latent
gathered and expanded by every rank's kv_b, and the keys and values gathered (the fallback), against the whole
sequence in one process: outputs, the input's gradient and every parameter's gradient (summed over the cp ranks),
with documents crossing chunk boundaries. Model-level parity: tests/launches/test_parity.py."""

from __future__ import annotations

import copy
import datetime

import pytest
import torch

from compiler.parallelize.context_parallel import local_chunks
from tests.launch import spawn_ranks
from tests.models.common.test_latent_attention import D, _attention


def _both_paths_match_one_process() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from compiler.parallelize.context_parallel import ContextParallelAttention
    from compiler.parallelize.latent_gather import GatheredLatent, cores_with_whole_keys

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, cp = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    whole = _attention().double()  # the same weights on every rank
    gen = torch.Generator().manual_seed(0)
    B, T = 2, 8 * cp  # chunks of 4 tokens
    x = torch.randn(B, T, D, generator=gen, dtype=torch.float64, requires_grad=True)
    positions = torch.arange(T).expand(B, T)
    documents = torch.stack([torch.arange(T) // 9 + (torch.arange(T) >= 3), torch.zeros(T, dtype=torch.long)])
    want = whole(x, positions, documents)
    upstream = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    want_grads = torch.autograd.grad(want, (x, *whole.parameters()), upstream)

    for gathers_latent in (True, False):
        attn = copy.deepcopy(whole)
        if gathers_latent:
            attn.kv_latent = GatheredLatent(mesh)
        assert cores_with_whole_keys(attn) == ({"core"} if gathers_latent else set())  # what the engine tells the core
        attn.core = ContextParallelAttention(mesh, whole_keys=gathers_latent)
        mine = local_chunks(x.detach(), rank=rank, cp=cp).requires_grad_()
        got = attn(mine, local_chunks(positions, rank=rank, cp=cp), local_chunks(documents, rank=rank, cp=cp))
        path = "latent" if gathers_latent else "keys and values"
        torch.testing.assert_close(got, local_chunks(want, rank=rank, cp=cp), rtol=0, atol=1e-10,
                                   msg=lambda m: f"{path}, rank {rank}, output: {m}")
        got_grads = torch.autograd.grad(got, (mine, *attn.parameters()), local_chunks(upstream, rank=rank, cp=cp))
        torch.testing.assert_close(got_grads[0], local_chunks(want_grads[0], rank=rank, cp=cp), rtol=0, atol=1e-10)
        for (name, _), g, w in zip(whole.named_parameters(), got_grads[1:], want_grads[1:]):
            dist.all_reduce(g)  # each rank's tokens give part of every weight's gradient
            torch.testing.assert_close(g, w, rtol=0, atol=1e-10, msg=lambda m: f"{path}, rank {rank}, d{name}: {m}")
    dist.destroy_process_group()


@pytest.mark.slow
def test_gathered_latent_and_gathered_keys_equal_one_process():
    spawn_ranks(_both_paths_match_one_process, world_size=2, timeout=120)
