"""Mixture-of-experts bookkeeping around each step: the auxiliary loss's gradient scale, tokens per expert, and
the auxiliary-loss-free bias update (models/common/load_balance.py states the conventions).

Before a step every MoE layer's auxiliary-loss wrapper (compiler/parallelize/expert_parallel.py
``StepBalanceLoss``, the engine's module, not the model's) gets the scale the loss's gradient takes (S / m: the
fp16 loss scale over the micro-batches, as the cross-entropy's; times cp under context parallelism,
``before_step``). After the optimizer step each layer's tokens per expert of the step are summed over the ranks
that routed other tokens through it (``token_group``: dp x cp, and mp under sequence parallelism), and, with
``--expert-bias-rate``, every rank moves the router's selection bias by the same rule on the same counts
(DeepSeek-V3 sec. 2.1.2). The loads since the last log (max / mean per layer, the layers of every stage) reach the
logging rank in one world all-reduce. Under activation checkpointing a layer's recomputed forward counts its
tokens again: every count of the step doubles, which neither max / mean nor the bias update's sign sees.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from compiler.parallelize.activation_checkpointing import original_name
from compiler.parallelize.expert_parallel import StepBalanceLoss
from models import MoE, update_expert_bias


class ExpertBalance:
    def __init__(self, layers: dict[str, MoE], *, moe_layer_names: list[str], token_group: dist.ProcessGroup | None,
                 reports: bool, bias_rate: float, device: torch.device, context_parallel: int = 1):
        """``layers``: this rank's MoE modules by model name ("layers.3.moe"); ``moe_layer_names``: every MoE
        layer of the model, in order (the log's rows); ``reports``: this rank contributes its layers' loads to
        the log (one rank per stage: the plane's first)."""
        self.layers, self.names, self.token_group = layers, moe_layer_names, token_group
        self.reports, self.bias_rate, self.device = reports, bias_rate, device
        self.since_log = {name: None for name in layers}
        self.context_parallel = context_parallel
        self.balances = [_step_balance(name, m) for name, m in layers.items() if m.balance is not None]

    @classmethod
    def of(cls, named_modules, **kwargs) -> "ExpertBalance | None":
        layers = {original_name(name): m for name, m in named_modules if isinstance(m, MoE)}
        return cls(layers, **kwargs) if kwargs["moe_layer_names"] else None

    def before_step(self, *, loss_scale: float, microbatches: int) -> None:
        """S / m, as the cross-entropy's; times cp: a context-parallel rank's auxiliary loss is its share of its
        sequences' loss (the shares add up), while data parallelism averages gradients over the cp ranks as it
        must their cross-entropies (each a mean over its own tokens)."""
        for balance in self.balances:
            balance.grad_scale = loss_scale / microbatches * self.context_parallel

    def after_step(self, *, update_bias: bool) -> None:
        """Tokens per expert of the step, summed over the token group; the bias update (every rank alike; not
        after a skipped step)."""
        if not self.layers:
            return
        names = list(self.layers)
        counts = [self.layers[n].take_tokens_per_expert() for n in names]
        counts = torch.stack([c if c is not None else torch.zeros(self.layers[n].experts.n_experts, dtype=torch.long,
                                                                   device=self.device) for n, c in zip(names, counts)])
        if self.token_group is not None:
            dist.all_reduce(counts, group=self.token_group)
        for name, layer_counts in zip(names, counts):
            self.since_log[name] = layer_counts if self.since_log[name] is None else self.since_log[name] + layer_counts
            bias = getattr(self.layers[name].router, "expert_bias", None)
            if update_bias and self.bias_rate > 0 and bias is not None:
                with torch.no_grad():
                    bias.copy_(update_expert_bias(bias, layer_counts, self.bias_rate))

    def loads(self) -> dict[str, float]:
        """max / mean tokens per expert of every MoE layer since the last call, on every rank (one world
        all-reduce: each stage's reporting rank fills its layers' rows)."""
        rows = torch.zeros(len(self.names), dtype=torch.float64, device=self.device)
        if self.reports:
            for name, counts in self.since_log.items():
                if counts is not None and counts.sum() > 0:
                    c = counts.double()
                    rows[self.names.index(name)] = c.max() / c.mean()
        if dist.is_initialized():
            dist.all_reduce(rows)
        self.since_log = {name: None for name in self.layers}
        return {name: float(v) for name, v in zip(self.names, rows)}


def _step_balance(name: str, moe: MoE) -> StepBalanceLoss:
    if not isinstance(moe.balance, StepBalanceLoss):  # else its gradient would silently keep scale 1
        raise TypeError(f"{name}'s auxiliary loss is not the engine's (apply_moe_parallelism wraps it)")
    return moe.balance
