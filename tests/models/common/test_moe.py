"""The shared mixture-of-experts block (models/common/moe.py, router.py, grouped_mm.py, load_balance.py) against
computations written out token by token here: every routing option (softmax / sigmoid scores, top-k,
norm_topk_prob, routed_scaling_factor, the selection-only bias, group-limited routing), dropless dispatch and
combine, shared experts, the grouped product and its gradients, the auxiliary loss's value and gradient, the bias
update's sign rule, the load counts; and DeepSeek-V3's router weights from its transformers fixture."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from models import MoE, update_expert_bias
from models.common.grouped_mm import grouped_mm
from models.common.load_balance import sequence_balance_loss
from models.common.moe import GroupedExperts, block_kinds
from models.common.router import SIGMOID, Router, Routing
from tests.paths import FIXTURE_ROOT

D, E = 16, 8


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _router(routing: Routing, *, seed: int = 0, bias: torch.Tensor | None = None) -> Router:
    router = Router(D, E, routing)
    with torch.no_grad():
        router.gate.weight.copy_(torch.randn(E, D, generator=_gen(seed)))  # well-separated scores
        if bias is not None:
            router.expert_bias.copy_(bias)
    return router


# ---- the router, token by token -------------------------------------------------------------------------------

def reference_route(x: torch.Tensor, gate: torch.Tensor, r: Routing, bias: list[float] | None = None):
    """Per token, in Python floats: scores, the selection scores (plus the bias), the groups kept (ranked by the sum
    of their two best selection scores), the top-k of the kept experts, their unbiased scores as weights,
    renormalised and scaled as asked. Returns ([experts per token], [weights per token])."""
    chosen, weights = [], []
    for row in (x.double() @ gate.double().t()).tolist():
        if r.score_func == SIGMOID:
            scores = [1 / (1 + math.exp(-v)) for v in row]
        else:
            top = max(row)
            exps = [math.exp(v - top) for v in row]
            scores = [e / sum(exps) for e in exps]
        select = [s + (bias[i] if bias else 0.0) for i, s in enumerate(scores)]
        allowed = set(range(E))
        if r.n_group > 1:
            size = E // r.n_group
            group_score = {g: sum(sorted(select[g * size:(g + 1) * size])[-2:]) for g in range(r.n_group)}
            kept = sorted(group_score, key=group_score.get, reverse=True)[:r.topk_group]
            allowed = {g * size + j for g in kept for j in range(size)}
        experts = sorted(allowed, key=lambda i: select[i], reverse=True)[:r.top_k]
        w = [scores[i] for i in experts]
        if r.norm_topk_prob:
            w = [v / sum(w) for v in w]
        chosen.append(experts)
        weights.append([v * r.routed_scaling_factor for v in w])
    return chosen, weights


ROUTINGS = {
    "softmax-top2": Routing(top_k=2),
    "softmax-top3-renormalised": Routing(top_k=3, norm_topk_prob=True),
    "sigmoid-top2": Routing(top_k=2, score_func=SIGMOID),
    "sigmoid-renormalised-scaled": Routing(top_k=3, score_func=SIGMOID, norm_topk_prob=True, routed_scaling_factor=2.5),
    "groups-4-keep-2": Routing(top_k=3, score_func=SIGMOID, n_group=4, topk_group=2, norm_topk_prob=True),
}


@pytest.mark.parametrize("name", list(ROUTINGS))
def test_the_router_chooses_and_weighs_as_the_hand_computation(name):
    routing = ROUTINGS[name]
    router = _router(routing)
    x = torch.randn(64, D, generator=_gen(1))
    routes = router(x)
    experts, weights = reference_route(x, router.gate.weight.detach(), routing)
    assert routes.experts.tolist() == experts
    torch.testing.assert_close(routes.weights, torch.tensor(weights, dtype=torch.float32), rtol=1e-5, atol=1e-6)
    assert routes.experts.dtype == torch.int64 and routes.weights.dtype == routes.scores.dtype == torch.float32


def test_the_options_change_what_they_should():
    x = torch.randn(64, D, generator=_gen(1))
    plain = _router(Routing(top_k=3, score_func=SIGMOID))(x)
    scaled = _router(Routing(top_k=3, score_func=SIGMOID, routed_scaling_factor=2.5))(x)
    torch.testing.assert_close(scaled.weights, 2.5 * plain.weights)
    renormalised = _router(Routing(top_k=3, score_func=SIGMOID, norm_topk_prob=True))(x)
    torch.testing.assert_close(renormalised.weights.sum(-1), torch.ones(64))
    assert not torch.allclose(plain.weights.sum(-1), torch.ones(64), atol=0.1)  # sigmoid scores do not sum to 1
    grouped = _router(Routing(top_k=3, score_func=SIGMOID, n_group=4, topk_group=2))(x)
    assert (grouped.experts != plain.experts).any()  # the group limit changes choices here ...
    groups = grouped.experts // (E // 4)  # ... and every token's experts come from at most 2 of the 4 groups
    assert all(len(set(g)) <= 2 for g in groups.tolist())


def test_the_selection_bias_changes_the_chosen_experts_not_their_weights():
    bias = torch.tensor([0.3, -0.2, 0.0, 0.25, -0.3, 0.1, 0.0, -0.1])
    routing = Routing(top_k=2, score_func=SIGMOID, expert_bias=True)
    x = torch.randn(64, D, generator=_gen(1))
    biased, unbiased = _router(routing, bias=bias)(x), _router(routing)(x)
    changed = (biased.experts != unbiased.experts).any(-1).float().mean()
    assert changed > 0.2  # the bias picks other experts for many tokens
    torch.testing.assert_close(biased.scores, unbiased.scores)  # scores and so weights ignore it:
    torch.testing.assert_close(biased.weights, unbiased.scores.gather(-1, biased.experts))
    experts, _ = reference_route(x, _router(routing).gate.weight.detach(), routing, bias=bias.tolist())
    assert biased.experts.tolist() == experts
    router = _router(routing, bias=bias)
    assert not router.expert_bias.requires_grad and "expert_bias" in dict(router.named_parameters())


def test_bad_routing_options_are_refused():
    for routing, words in ((Routing(top_k=9), "top_k 9"), (Routing(top_k=2, n_group=3), "n_group 3"),
                           (Routing(top_k=5, n_group=4, topk_group=2), "topk_group 2"),
                           (Routing(top_k=2, score_func="relu"), "relu")):
        with pytest.raises(ValueError, match=words):
            Router(D, E, routing)


# ---- dispatch, experts, combine ----------------------------------------------------------------------------------

def _moe(routing: Routing, *, shared_width: int = 0, aux_loss_coef: float = 0.0, seed: int = 0) -> MoE:
    moe = MoE(d_model=D, expert_width=12, n_experts=E, routing=routing, shared_width=shared_width,
              aux_loss_coef=aux_loss_coef)
    g = _gen(seed)
    with torch.no_grad():
        for p in moe.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 if p.dim() == 2 and p.shape == (E, D) else 0.3))
    return moe


def reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: each of its k experts applied alone (a SwiGLU of that expert's slices), times its weight,
    summed; the shared experts' SwiGLU added."""
    tokens = x.reshape(-1, D)
    routes = moe.router(tokens)
    w1, w3, w2 = moe.experts.w1, moe.experts.w3, moe.experts.w2
    rows = []
    for t in range(tokens.shape[0]):
        out = torch.zeros(D)
        for e, weight in zip(routes.experts[t].tolist(), routes.weights[t]):
            xt = tokens[t]
            out = out + weight * (w2[e] @ (F.silu(w1[e] @ xt) * (w3[e] @ xt)))
        if moe.shared_experts is not None:
            out = out + moe.shared_experts(tokens[t])
        rows.append(out)
    return torch.stack(rows).view_as(x)


@pytest.mark.parametrize("shared", [0, 20])
def test_the_block_computes_every_tokens_k_experts_and_its_shared_experts(shared):
    moe = _moe(Routing(top_k=3, norm_topk_prob=True), shared_width=shared)
    x = torch.randn(2, 10, D, generator=_gen(2))
    with torch.no_grad():
        torch.testing.assert_close(moe(x), reference_moe(moe, x), rtol=1e-5, atol=1e-5)
    if shared:
        without = _moe(Routing(top_k=3, norm_topk_prob=True))
        with torch.no_grad():
            torch.testing.assert_close(moe(x) - moe.shared_experts(x), without(x), rtol=1e-5, atol=1e-5)


def test_dropless_when_every_token_chooses_the_same_expert():
    moe = _moe(Routing(top_k=2))
    with torch.no_grad():
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[5] = 50.0  # every token's best expert is 5
    x = torch.randn(2, 12, D, generator=_gen(3)).abs()
    moe.train()
    with torch.no_grad():
        torch.testing.assert_close(moe(x), reference_moe(moe, x), rtol=1e-5, atol=1e-5)
    counts = moe.take_tokens_per_expert()
    assert counts[5] == 24 and counts.sum() == 24 * 2  # 24 tokens, none dropped


def test_grouped_mm_and_its_gradients_are_a_product_per_expert():
    g = _gen(4)
    counts = torch.tensor([3, 0, 5, 1])  # an expert without rows; 2 padding rows after the 9
    x = torch.randn(11, 6, generator=g, requires_grad=True)
    w = torch.randn(4, 7, 6, generator=g, requires_grad=True)
    out = grouped_mm(x, w, counts.cumsum(0, dtype=torch.int32))
    rows, start = [], 0
    for e, n in enumerate(counts.tolist()):
        rows.append(x[start:start + n] @ w[e].t())
        start += n
    want = torch.cat([*rows, torch.zeros(2, 7)])
    torch.testing.assert_close(out, want)
    grad = torch.randn(11, 7, generator=g)
    got = torch.autograd.grad(out, (x, w), grad)
    expected = torch.autograd.grad(want, (x, w), grad)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    assert torch.autograd.gradcheck(lambda a, b: grouped_mm(a, b, counts.cumsum(0, dtype=torch.int32)),
                                    (x.detach().double().requires_grad_(), w.detach().double().requires_grad_()))


def test_grouped_experts_compute_in_the_autocast_dtype():
    experts = GroupedExperts(8, 12, 3)
    x, counts = torch.randn(7, 8, generator=_gen(5)), torch.tensor([2, 4, 1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert experts(x, counts).dtype == torch.bfloat16
    assert experts(x, counts).dtype == torch.float32


def test_load_counts_accumulate_in_training_and_reset_when_taken():
    moe = _moe(Routing(top_k=2))
    x = torch.randn(2, 6, D, generator=_gen(6))
    moe.eval()
    moe(x)
    assert moe.take_tokens_per_expert() is None  # evaluation does not count
    moe.train()
    moe(x)
    moe(x[:1])
    counts = moe.take_tokens_per_expert()
    chosen = torch.cat([moe.router(x.reshape(-1, D)).experts.flatten(), moe.router(x[0]).experts.flatten()])
    assert counts.tolist() == [int((chosen == e).sum()) for e in range(E)] and counts.sum() == (12 + 6) * 2
    assert moe.take_tokens_per_expert() is None


def test_block_kinds_follow_deepseek_and_qwen_rules():
    assert block_kinds(5, first_k_dense=2) == ("dense", "dense", "moe", "moe", "moe")  # first_k_dense_replace
    assert block_kinds(4, sparse_step=2) == ("dense", "moe", "dense", "moe")  # decoder_sparse_step
    assert block_kinds(4, dense_layers=(0, 2)) == ("dense", "moe", "dense", "moe")  # mlp_only_layers
    assert block_kinds(61, first_k_dense=3).count("moe") == 58  # DeepSeek-V3: 3 dense layers of 61


# ---- load balancing ----------------------------------------------------------------------------------------------

def reference_balance_loss(scores: torch.Tensor, experts: torch.Tensor, batch: int) -> float:
    """DeepSeek-V3 eq. 17-20 per sequence, in Python: f_i = E / (k T) * count_i, P_i = mean_t normalised s_it,
    sum_i f_i P_i, averaged over the sequences."""
    n, n_experts = scores.shape
    k, t = experts.shape[1], n // batch
    total = 0.0
    for b in range(batch):
        rows = range(b * t, (b + 1) * t)
        count = [sum(int(e == i) for r in rows for e in experts[r].tolist()) for i in range(n_experts)]
        p = [sum(float(scores[r, i].item() / scores[r].sum().item()) for r in rows) / t for i in range(n_experts)]
        total += sum(n_experts / (k * t) * count[i] * p[i] for i in range(n_experts))
    return total / batch


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_the_auxiliary_loss_is_deepseeks_sequence_wise_balance_loss(score_func):
    router = _router(Routing(top_k=2, score_func=score_func))
    x = torch.randn(3 * 7, D, generator=_gen(7))
    routes = router(x)
    got = sequence_balance_loss(routes.scores, routes.experts, batch=3)
    assert got.item() == pytest.approx(reference_balance_loss(routes.scores, routes.experts, 3), rel=1e-5)
    # Per sequence: a batch's loss is the mean of its halves' losses, however it is split into micro-batches.
    halves = [sequence_balance_loss(routes.scores[a:b], routes.experts[a:b], batch=n)
              for a, b, n in ((0, 7, 1), (7, 21, 2))]
    assert got.item() == pytest.approx((halves[0].item() + 2 * halves[1].item()) / 3, rel=1e-6)
    uniform = torch.full((8, E), 1.0 / E), torch.arange(16).remainder(E).view(8, 2)
    assert sequence_balance_loss(*uniform, batch=1).item() == pytest.approx(1.0)  # balanced: 1


def test_shares_of_a_sequence_split_over_ranks_add_up_to_its_loss_and_gradient():
    """Sequence / context parallelism: each of 3 ranks holds a third of every sequence's tokens (interleaved
    runs, as load-balanced chunks are); the shares sum to the loss of the whole sequences, and so do their
    gradients."""
    scores = torch.randn(2 * 12, E, generator=_gen(9), dtype=torch.float64).softmax(-1).requires_grad_()
    experts = scores.detach().topk(2, dim=-1).indices
    whole = sequence_balance_loss(scores, experts, batch=2)
    pieces = [torch.tensor([0, 1, 2, 9]), torch.tensor([3, 4, 10, 11]), torch.tensor([5, 6, 7, 8])]  # positions of each rank
    rows = [torch.cat([b * 12 + piece for b in range(2)]) for piece in pieces]

    def counts_of(rows_):
        chosen = experts[rows_].reshape(2, -1)
        return torch.zeros(2, E, dtype=torch.float64).scatter_add(1, chosen, torch.ones(chosen.shape, dtype=torch.float64))
    total_counts = sum(counts_of(r) for r in rows)
    shares = [sequence_balance_loss(scores[r], experts[r], batch=2, shards=3, sum_over_shards=lambda c: total_counts)
              for r in rows]
    torch.testing.assert_close(sum(shares), whole)
    torch.testing.assert_close(torch.autograd.grad(sum(shares), scores)[0], torch.autograd.grad(whole, scores)[0])


def test_the_auxiliary_losss_gradient_is_exact():
    scores = torch.randn(12, E, generator=_gen(8), dtype=torch.float64).softmax(-1)
    experts = scores.topk(2, dim=-1).indices
    assert torch.autograd.gradcheck(lambda s: sequence_balance_loss(s, experts, batch=3), (scores.requires_grad_(),))


def test_the_auxiliary_loss_reaches_the_router_in_backward_without_changing_the_output():
    coef = 0.25
    moe = _moe(Routing(top_k=2, norm_topk_prob=True), aux_loss_coef=coef)
    x = torch.randn(2, 9, D, generator=_gen(9))
    gate = moe.router.gate.weight
    moe.eval()
    out_eval = moe(x)
    (plain,) = torch.autograd.grad(out_eval.square().sum(), gate)
    moe.train()
    routes = moe.router(x.reshape(-1, D))
    (aux_grad,) = torch.autograd.grad(sequence_balance_loss(routes.scores, routes.experts, batch=2), gate)
    out = moe(x)  # alone, without the engine: one process, one micro-batch, no loss scaling (scale 1)
    torch.testing.assert_close(out, out_eval, rtol=0, atol=0)  # forward unchanged
    (got,) = torch.autograd.grad(out.square().sum(), gate)
    torch.testing.assert_close(got, plain + coef * aux_grad, rtol=1e-5, atol=1e-6)
    assert moe.aux_loss.item() == pytest.approx(sequence_balance_loss(routes.scores, routes.experts, batch=2).item())
    assert not torch.allclose(aux_grad, torch.zeros_like(aux_grad))
    # The loss's options are arguments of its module, which the engine wraps (compiler/parallelize/expert_parallel.py).
    routes, base = moe.router(x.reshape(-1, D)), moe.eval()(x)
    out, aux = moe.balance(base, routes.scores, routes.experts, batch=2, grad_scale=0.125)
    (scaled,) = torch.autograd.grad(out.square().sum(), gate)
    torch.testing.assert_close(scaled, plain + coef * 0.125 * aux_grad, rtol=1e-5, atol=1e-6)
    assert not aux.requires_grad and moe.balance.coef == coef


def test_a_block_without_an_auxiliary_loss_has_no_balance_module():
    moe = _moe(Routing(top_k=2))
    assert moe.balance is None and "balance" not in dict(moe.named_children())
    moe(torch.randn(2, 3, D, generator=_gen(10))).sum().backward()
    assert moe.aux_loss is None


def test_the_bias_update_moves_each_expert_against_its_load():
    bias = torch.tensor([0.0, 0.5, -0.5, 0.1])
    counts = torch.tensor([10, 2, 6, 6])  # mean 6: overloaded, underloaded, exactly mean, exactly mean
    new = update_expert_bias(bias, counts, gamma=0.01)
    torch.testing.assert_close(new, torch.tensor([-0.01, 0.51, -0.5, 0.1]))
    assert torch.equal(bias, torch.tensor([0.0, 0.5, -0.5, 0.1]))  # pure: the caller writes it back


# ---- DeepSeek-V3's router, from its transformers fixture ---------------------------------------------------------

# transformers' DeepseekV3ForCausalLM folder (tests/fixtures/README.md); its whole model: tests/models/test_hf_fixtures.py.
DEEPSEEK = FIXTURE_ROOT / "hf-models" / "deepseek-v3"


def test_deepseek_v3s_router_weights_route_as_its_config_says():
    """Layer 1's gate and e_score_correction_bias from the fixture, DeepSeek-V3's options from its config.json
    (sigmoid, 3 groups keep 2 by best-2 sums, top 3, renormalised, times 1.5): the router and the hand computation
    agree on random hidden states, and the bias changes the chosen set for many tokens, as the fixture says."""
    import json

    from runtime.checkpoint.hf_folder import HFFolder

    folder = HFFolder.open(DEEPSEEK)
    config = json.loads((DEEPSEEK / "config.json").read_text())
    routing = Routing(top_k=config["num_experts_per_tok"], score_func=SIGMOID, norm_topk_prob=config["norm_topk_prob"],
                      n_group=config["n_group"], topk_group=config["topk_group"], expert_bias=True,
                      routed_scaling_factor=config["routed_scaling_factor"])
    gate = folder.read("model.layers.1.mlp.gate.weight").clone()
    bias = folder.read("model.layers.1.mlp.gate.e_score_correction_bias").clone()
    router = Router(config["hidden_size"], config["n_routed_experts"], routing)
    with torch.no_grad():
        router.gate.weight.copy_(gate)
        router.expert_bias.copy_(bias)
    x = torch.randn(256, config["hidden_size"], generator=_gen(10))
    routes = router(x)
    experts, weights = reference_route(x, gate, routing, bias=bias.tolist())
    assert routes.experts.tolist() == experts
    torch.testing.assert_close(routes.weights, torch.tensor(weights, dtype=torch.float32), rtol=1e-5, atol=1e-6)
    unbiased, _ = reference_route(x, gate, routing)
    changed = sum(set(a) != set(b) for a, b in zip(experts, unbiased)) / len(experts)
    assert changed > 0.3, changed
