"""The mixture-of-experts block every MoE family shares (Shazeer et al. 2017; Mixtral, Qwen3-MoE, DeepSeek-V3).

``MoE`` replaces a block's MLP: each token's hidden state goes to the k experts its router picks, their outputs
are summed with the gating weights, and shared experts (a dense SwiGLU beside the routed ones, DeepSeek-V3) add
theirs. Dropless: every one of a token's k assignments is computed, whatever the load (no capacity, no drops).
Its submodules, which the engine addresses by name:

- ``router`` (router.py): ``gate`` (E, D) and, with a selection bias, ``expert_bias`` (E,);
- ``experts`` (``GroupedExperts``, or a family's own: gpt-oss's clamped SwiGLU with biases): the routed experts'
  stacked parameters (each [E, ...], dim 0 the expert) and their computation on rows already sorted by expert,
  ``compute(x, counts, *parameters in registration order)``, which ``forward(x, counts)`` calls with its own. It is
  a module of its own so that expert parallelism can wrap it without touching the rest
  (as torchtitan's ExpertParallel wraps its GroupedExperts): the wrapper receives ``experts(x_sorted, counts)``'s
  arguments (the rows of all E experts, sorted by expert, and the (E,) counts), sends each expert's rows to the
  rank holding it (all-to-all), calls ``compute`` there with that rank's rows sorted by its local experts, their
  local counts and its parameters' local experts (E/ep along dim 0: biases travel with their experts), and sends
  the outputs back in the order it received them;
- ``shared_experts`` (a ``SwiGLU``, Hugging Face's ``shared_experts``) when the family has them;
- ``balance`` (load_balance.py's ``BalanceLoss``, no parameters) when the family has an auxiliary loss: the block
  hands it the router's scores and choices in training and gets its output back with the loss's gradient
  attached. The engine wraps it to pass what only the engine knows, the sequence split over ranks and the step's
  gradient scale (compiler/parallelize/expert_parallel.py); alone, the block computes one process's loss.

Forward, for x (B, T, D) flattened to N = B T tokens: route (N, k); count the assignments per expert with
``scatter_add`` (static shapes: never ``bincount``); sort the N k assignments by expert (a stable argsort: token
order within an expert); gather their tokens (N k, D); ``experts``; multiply by the gating weights; add them back
to token order with ``index_add``. Every shape is static, so the block traces on the meta device (the engine's
trace) and runs under FakeTensorMode (compiler/cost.py counts the FLOPs of the k activated experts per token).

What the engine reads, on each ``MoE`` module (``isinstance(m, MoE)`` over ``model.modules()``):

- ``take_tokens_per_expert()``: the (E,) int64 assignments per expert routed by this module in training forwards
  since the last call (None if none), and resets the count; for logging the load (max / mean) and for the bias
  update. Under activation checkpointing the recomputed forward counts again (a factor of 2 on every expert, which
  neither max / mean nor the bias update's sign sees). Recorded only when running eagerly (not while exported).
- ``aux_loss``: the last training forward's auxiliary loss (0-d, detached), for logging.
- ``router.expert_bias``: updated with load_balance.py's ``update_expert_bias`` after the optimizer step (a
  parameter, written like any weight).

An ``EagerModule`` (models/spec.py): the engine runs it eagerly, putting it back in place of its traced copy, since
the counting and the auxiliary loss's backward live in Python, which a traced graph does not keep. Its forward has
static shapes, so it is its own ``trace_forward``; while exported it neither counts nor attaches the loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.common.grouped_mm import grouped_mm
from models.common.load_balance import BalanceLoss
from models.common.mlp import SwiGLU
from models.common.router import Router, Routing
from models.spec import DENSE, MOE, EagerModule


def experts_swiglu(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                   w2: torch.Tensor) -> torch.Tensor:
    """E SwiGLU experts on rows sorted by expert: x (M, D), counts (E,) rows per expert (their sum at most M; rows
    past it give zeros), w1 / w3 (E, F, D), w2 (E, D, F) -> (M, D), row r of expert e giving
    w2[e] (silu(w1[e] x_r) * w3[e] x_r). The grouped matrix products of grouped_mm.py: torch's grouped GEMM where
    the device has a fast one (CUDA SM90+, bf16; registered by compiler/torch_compat.py), a loop over the experts
    elsewhere. Under autocast the experts compute in the autocast dtype, as an ``nn.Linear`` would. Expert
    parallelism calls this with a rank's local experts' weights and rows (compiler/parallelize/expert_parallel.py)."""
    offsets = counts.cumsum(0, dtype=torch.int32)  # (E,) where each expert's rows end
    dtype = autocast_dtype(x.device.type)
    if dtype is not None:  # the custom operator is not on autocast's lists: cast as autocast would
        x, w1, w3, w2 = (t.to(dtype) for t in (x, w1, w3, w2))
    h = F.silu(grouped_mm(x, w1, offsets)) * grouped_mm(x, w3, offsets)  # (M, F)
    return grouped_mm(h, w2, offsets)  # (M, D)


class GroupedExperts(nn.Module):
    """E SwiGLU experts, stacked: ``w1`` (gate) (E, F, D), ``w3`` (up) (E, F, D), ``w2`` (down) (E, D, F), registered
    in that order (``experts_swiglu``'s). ``forward(x, counts)``: x (M, D) rows sorted by expert, counts (E,) rows
    per expert -> (M, D)."""

    compute = staticmethod(experts_swiglu)  # (x, counts, w1, w3, w2): what expert parallelism calls per rank

    def __init__(self, d_model: int, width: int, n_experts: int):
        super().__init__()
        self.n_experts = n_experts
        self.w1 = nn.Parameter(torch.empty(n_experts, width, d_model).normal_(std=0.02))
        self.w3 = nn.Parameter(torch.empty(n_experts, width, d_model).normal_(std=0.02))
        self.w2 = nn.Parameter(torch.empty(n_experts, d_model, width).normal_(std=0.02))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.compute(x, counts, self.w1, self.w3, self.w2)


class MoE(EagerModule):
    def __init__(self, *, d_model: int, expert_width: int, n_experts: int, routing: Routing, shared_width: int = 0,
                 aux_loss_coef: float = 0.0, experts: nn.Module | None = None):
        """``shared_width``: the shared experts' SwiGLU width (n_shared_experts x the expert width), 0 for none;
        ``aux_loss_coef``: the auxiliary loss's coefficient (router_aux_loss_coef), 0 for none; ``experts``: the
        routed experts (module docstring; ``n_experts`` of them), SwiGLU ``GroupedExperts`` of ``expert_width``
        when None."""
        super().__init__()
        self.router = Router(d_model, n_experts, routing)
        self.experts = GroupedExperts(d_model, expert_width, n_experts) if experts is None else experts
        if self.experts.n_experts != n_experts:
            raise ValueError(f"experts: {self.experts.n_experts} experts, the router chooses among {n_experts}")
        self.shared_experts = SwiGLU(d_model, shared_width) if shared_width else None
        self.balance = BalanceLoss(aux_loss_coef) if aux_loss_coef > 0 else None
        self.aux_loss: torch.Tensor | None = None
        self._tokens_per_expert: torch.Tensor | None = None

    @property
    def top_k(self) -> int:
        return self.router.routing.top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        tokens = x.reshape(-1, D)  # (N, D)
        routes = self.router(tokens)  # experts, weights (N, k); scores (N, E)
        k, n_experts = routes.experts.shape[1], routes.scores.shape[1]
        chosen = routes.experts.flatten()  # (N k,): token t's assignments at t k .. t k + k - 1
        counts = chosen.new_zeros(n_experts).scatter_add(0, chosen, torch.ones_like(chosen))  # (E,)
        order = chosen.argsort(stable=True)  # (N k,): assignments grouped by expert, token order within each
        token_of = order // k  # (N k,): the token of each sorted assignment
        y = self.experts(tokens[token_of], counts)  # (N k, D)
        y = y * routes.weights.flatten()[order].unsqueeze(-1).type_as(y)  # gated, in the experts' dtype
        out = y.new_zeros(tokens.shape).index_add(0, token_of, y)  # (N, D): each token's k outputs summed
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        if self.training and not torch.compiler.is_exporting():  # a traced graph keeps neither (module docstring)
            self._count(counts.detach())
            if self.balance is not None and torch.is_grad_enabled():
                out, self.aux_loss = self.balance(out, routes.scores, routes.experts, batch=B)
        return out.view(B, T, D)

    def _count(self, counts: torch.Tensor) -> None:
        self._tokens_per_expert = counts if self._tokens_per_expert is None else self._tokens_per_expert + counts

    def take_tokens_per_expert(self) -> torch.Tensor | None:
        """(E,) assignments per expert since the last call (training forwards only), and start counting anew."""
        counts, self._tokens_per_expert = self._tokens_per_expert, None
        return counts


def block_kinds(n_layers: int, *, first_k_dense: int = 0, sparse_step: int = 1,
                dense_layers: tuple[int, ...] = ()) -> tuple[str, ...]:
    """Which blocks are MoE: block i is MoE unless i < ``first_k_dense`` (DeepSeek-V3's first_k_dense_replace), or
    (i + 1) is not a multiple of ``sparse_step`` (Qwen3-MoE's decoder_sparse_step), or i is in ``dense_layers``
    (Qwen3-MoE's mlp_only_layers)."""
    return tuple(MOE if i >= first_k_dense and (i + 1) % sparse_step == 0 and i not in dense_layers else DENSE
                 for i in range(n_layers))


def inactive_expert_parameters(model: nn.Module) -> int:
    """Routed-expert parameters a token does not use: (E - k) / E of every MoE module's experts. The model's
    activated parameters are its parameters less these (embeddings and the head included, as model cards count)."""
    return sum(sum(p.numel() for p in m.experts.parameters()) * (m.experts.n_experts - m.top_k) // m.experts.n_experts
               for m in model.modules() if isinstance(m, MoE))


def autocast_dtype(device_type: str) -> torch.dtype | None:
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None
