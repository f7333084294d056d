"""gpt-oss's mixture (models/gpt_oss/experts.py, models/common/router.py): the clamped-SwiGLU experts with biases on
rows sorted by expert against transformers' per-expert loop (GptOssExperts, transcribed from the fixture README's
formulas), with the clamp active; each rank's experts computing with its rows of the stacked parameters, biases
included, as expert parallelism calls them; the router's bias and softmax over the top-k logits against
GptOssTopKRouter's; the whole block against a per-token reference."""

from __future__ import annotations

import torch

from models.common.moe import MoE
from models.common.router import Router
from models.gpt_oss.config import GptOssConfig, alternating_layers
from models.gpt_oss.experts import ClampedSwiGLUExperts, expert_of_rows

E, D, F, LIMIT, ALPHA = 4, 12, 6, 7.0, 1.702


def _experts(seed: int = 0) -> ClampedSwiGLUExperts:
    experts = ClampedSwiGLUExperts(D, F, E, limit=LIMIT, alpha=ALPHA).double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 2)  # wide: the clamps bite
    return experts


def transformers_expert(x: torch.Tensor, experts: ClampedSwiGLUExperts, e: int) -> torch.Tensor:
    """GptOssExperts' loop body for expert ``e`` (x @ W: input-major; gate/up interleaved)."""
    gate_up = x @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate, up = gate.clamp(min=None, max=LIMIT), up.clamp(min=-LIMIT, max=LIMIT)
    glu = gate * torch.sigmoid(gate * ALPHA)
    return ((up + 1) * glu) @ experts.down_proj[e] + experts.down_proj_bias[e]


def test_the_rows_of_each_expert_get_its_weights_and_biases():
    experts = _experts()
    counts = torch.tensor([3, 0, 4, 2])
    x = torch.randn(9, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64, requires_grad=True)
    got = experts(x, counts)
    rows = torch.repeat_interleave(torch.arange(E), counts)
    want = torch.cat([transformers_expert(x[i:i + 1], experts, int(e)) for i, e in enumerate(rows)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    h = torch.cat([x[i:i + 1] @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e] for i, e in enumerate(rows)])
    assert (h[:, ::2] > LIMIT).any() and (h[:, 1::2].abs() > LIMIT).any()  # both clamps bite
    params = [x, *experts.parameters()]
    for a, b in zip(torch.autograd.grad(got.square().sum(), params), torch.autograd.grad(want.square().sum(), params)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_expert_of_rows_follows_the_cumulative_counts():
    offsets = torch.tensor([3, 3, 7, 9], dtype=torch.int32)
    assert expert_of_rows(offsets, 9).tolist() == [0, 0, 0, 2, 2, 2, 2, 3, 3]
    assert expert_of_rows(offsets, 11).tolist()[-2:] == [3, 3]  # padding rows: the last expert's (their output is 0)


def test_each_ranks_experts_compute_with_its_rows_of_every_parameter():
    """Expert parallelism over 2 ranks: rank r holds experts 2r, 2r+1 (rows of all four stacked parameters) and gets
    their rows; the outputs are the whole module's rows."""
    experts = _experts()
    counts = torch.tensor([2, 3, 1, 4])
    x = torch.randn(10, D, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    whole = experts(x, counts)
    params = [p.detach() for p in experts.parameters()]  # registration order: what expert parallelism passes
    first = experts.compute(x[:5], counts[:2], *(p[:2] for p in params))
    second = experts.compute(x[5:], counts[2:], *(p[2:] for p in params))
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=0, atol=1e-12)


def test_the_router_takes_its_bias_and_a_softmax_over_the_chosen_logits():
    cfg = GptOssConfig(n_layers=1, d_model=D, n_heads=2, n_kv_heads=1, head_dim=4, seq_len=8, vocab_size=16,
                       mlp_width=F, n_experts=E, top_k=2, sliding_layers=alternating_layers(1))
    router = Router(D, E, cfg.routing()).double()
    with torch.no_grad():
        router.gate.bias.copy_(torch.tensor([3.0, -3.0, 0.5, 0.0]))
    x = torch.randn(20, D, generator=torch.Generator().manual_seed(3))
    routes = router(x)  # in fp32, as transformers' fp32 model
    logits = torch.nn.functional.linear(x, router.gate.weight.float(), router.gate.bias.float())  # GptOssTopKRouter
    top, chosen = logits.topk(2, dim=-1)
    assert torch.equal(routes.experts, chosen)
    torch.testing.assert_close(routes.weights, top.softmax(-1), rtol=0, atol=0)
    torch.testing.assert_close(routes.scores, logits.softmax(-1))  # the auxiliary loss's, over all E


def test_the_block_sums_each_tokens_two_experts_by_their_weights():
    cfg = GptOssConfig(n_layers=1, d_model=D, n_heads=2, n_kv_heads=1, head_dim=4, seq_len=8, vocab_size=16,
                       mlp_width=F, n_experts=E, top_k=2, sliding_layers=())
    experts = _experts(4)
    moe = MoE(d_model=D, expert_width=F, n_experts=E, routing=cfg.routing(), experts=experts).double().eval()
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    routes = moe.router(x.reshape(-1, D))
    want = torch.stack([sum(w * transformers_expert(t, experts, int(e)) for e, w in zip(es, ws))
                        for t, es, ws in zip(x.reshape(-1, D), routes.experts, routes.weights)])
    torch.testing.assert_close(moe(x), want.view(2, 5, D), rtol=0, atol=1e-12)
