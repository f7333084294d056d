"""Token-choice top-k routing: which k of E experts each token goes to, and with what gating weights.

The options cover the published routers (each one a config key of theirs):

- scores: ``softmax`` over the E gate logits (Mixtral, Qwen3-MoE) or an independent ``sigmoid`` per expert
  (DeepSeek-V3, sec. 2.1.2 eq. 15);
- group-limited routing (DeepSeek-V3's ``n_group`` / ``topk_group``, its node-limited routing sec. 2.1.2): the E
  experts form ``n_group`` equal groups, each group is ranked by the sum of its two best selection scores, and a
  token chooses its k experts only within its ``topk_group`` best groups (the others are masked with -inf;
  Hugging Face's DeepseekV3 masks with 0, which differs only when a selection score is negative);
- a selection-only bias (DeepSeek-V3's ``e_score_correction_bias``, the auxiliary-loss-free balancing of
  Wang et al. 2024): added to the scores to choose the experts (and to rank the groups), never to the gating
  weights, which are the unbiased scores of the chosen experts. It is updated by ``update_expert_bias``
  (load_balance.py), not by gradients;
- ``norm_topk_prob``: the k weights divided by their sum; ``routed_scaling_factor``: then multiplied by it.

- gpt-oss's router (``mlp.router``): the gate's logits have a bias (``gate_bias``) and the k weights are a softmax
  over the k chosen logits (``topk_softmax``: the softmax scores renormalised, e^l_i / sum_top-k e^l_j, computed
  as transformers computes them).

The gate (``gate``, an ``nn.Linear`` D -> E, Hugging Face's ``mlp.gate``) and everything after it
run in fp32, with autocast off: routing decisions taken on bf16 logits flip on rounding, and fp32 routing is what
DeepSeek-V3 and torchtitan do.

Parameters: ``gate.weight`` (E, D); ``expert_bias`` (E,) when the router has one. The engine materialises
parameters only (models have no buffers), so the bias is an ``nn.Parameter`` with ``requires_grad=False``: it is
saved in checkpoints and loaded like any weight, and no optimizer or gradient reduction touches it (its value
starts at zero, models/common/decoder.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from models.spec import ModelShapeError, ShapeProblem, divisors

SOFTMAX, SIGMOID = "softmax", "sigmoid"


@dataclass(frozen=True)
class Routing:
    """How a router chooses; defaults are Mixtral's / Qwen3-MoE's softmax top-k without renormalisation."""

    top_k: int
    score_func: str = SOFTMAX  # SOFTMAX or SIGMOID
    norm_topk_prob: bool = False
    n_group: int = 1  # groups of experts; 1: no group limit
    topk_group: int = 1  # groups a token may choose from (with n_group > 1)
    expert_bias: bool = False  # a selection-only bias (DeepSeek-V3's e_score_correction_bias)
    routed_scaling_factor: float = 1.0
    gate_bias: bool = False  # the gate's logits have a bias (gpt-oss), which picks experts and weighs them alike
    topk_softmax: bool = False  # the weights: a softmax over the k chosen logits (gpt-oss)

    def check(self, n_experts: int) -> ShapeProblem | None:
        """Why these options cannot route over ``n_experts`` experts, or None."""
        if self.score_func not in (SOFTMAX, SIGMOID):
            return ShapeProblem("score_func", self.score_func, "name a score function", valid=(SOFTMAX, SIGMOID))
        if not 1 <= self.top_k <= n_experts:
            return ShapeProblem("top_k", self.top_k, "be between 1 and", "n_experts", n_experts)
        if self.n_group > 1:
            if n_experts % self.n_group or n_experts // self.n_group < 2:
                return ShapeProblem("n_group", self.n_group, "divide", "n_experts", n_experts,
                                    reason="into groups of at least 2",
                                    valid=tuple(g for g in divisors(n_experts) if n_experts // g >= 2))
            group = n_experts // self.n_group
            holding = tuple(t for t in range(1, self.n_group + 1) if t * group >= self.top_k)
            if self.topk_group not in holding:  # the chosen groups must hold k experts
                return ShapeProblem("topk_group", self.topk_group, "choose groups holding at least", "top_k",
                                    self.top_k, reason=f"among the {self.n_group} groups of {group} experts", valid=holding)
        return None


@dataclass(frozen=True)
class Routes:
    """A router's decision for N tokens."""

    experts: torch.Tensor  # (N, k) int64: the chosen experts, best first
    weights: torch.Tensor  # (N, k) fp32: their gating weights
    scores: torch.Tensor  # (N, E) fp32: every expert's score (softmax or sigmoid), for the auxiliary loss


class Router(nn.Module):
    def __init__(self, d_model: int, n_experts: int, routing: Routing):
        super().__init__()
        problem = routing.check(n_experts)
        if problem:
            raise ModelShapeError(problem)
        self.routing = routing
        self.n_experts = n_experts
        self.gate = nn.Linear(d_model, n_experts, bias=routing.gate_bias)
        # Not trained by gradients; see the module docstring.
        self.expert_bias = nn.Parameter(torch.zeros(n_experts), requires_grad=False) if routing.expert_bias else None

    def forward(self, x: torch.Tensor) -> Routes:
        """x (N, D) -> the routes of its N tokens."""
        r = self.routing
        with _autocast_off(x.device.type):
            bias = None if self.gate.bias is None else as_fp32(self.gate.bias)
            logits = nn.functional.linear(as_fp32(x), as_fp32(self.gate.weight), bias)  # (N, E) fp32
        scores = logits.softmax(-1) if r.score_func == SOFTMAX else logits.sigmoid()  # (N, E)
        choice = scores if self.expert_bias is None else scores + self.expert_bias
        if r.n_group > 1:
            choice = limit_to_best_groups(choice, n_group=r.n_group, topk_group=r.topk_group)
        experts = choice.topk(r.top_k, dim=-1).indices  # (N, k), best first
        weights = scores.gather(-1, experts)  # (N, k): the unbiased scores of the chosen experts
        if r.topk_softmax:
            weights = logits.gather(-1, experts).softmax(-1)
        elif r.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        if r.routed_scaling_factor != 1.0:
            weights = weights * r.routed_scaling_factor
        return Routes(experts=experts, weights=weights, scores=scores)


def limit_to_best_groups(choice: torch.Tensor, *, n_group: int, topk_group: int) -> torch.Tensor:
    """(N, E) selection scores -> the same with every expert outside the token's ``topk_group`` best groups set
    to -inf; a group's rank is the sum of its two best scores (DeepSeek-V3's inference code and Hugging Face's)."""
    grouped = choice.unflatten(-1, (n_group, -1))  # (N, G, E/G)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (N, G)
    best = group_scores.topk(topk_group, dim=-1).indices  # (N, topk_group)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(-1, best, True)  # (N, G)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)  # (N, E)


def as_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, as a copy that stays in a traced graph: ``t.float()`` of an fp32 tensor traces to nothing
    but an assertion that t is fp32 on the trace's (meta) device, which fails when the graph runs elsewhere."""
    return torch.empty_like(t, dtype=torch.float32).copy_(t)


def _autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast disabled where it is on (the meta device of the engine's trace has no autocast)."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
