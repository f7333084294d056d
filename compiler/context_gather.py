"""What context parallelism all-gathers for each attention layer, chosen by size or by the plan: one rule the engine
(compiler/parallelize/stages.py) and the planner (compiler/planner/layers.py, work.py, activations.py) both read.

Every cp rank holds T/cp tokens and its queries need every token's keys and values. Two things can be gathered:
- ``KV``: the keys and values themselves (compiler/parallelize/context_parallel.py), per token and rank the
  rank's key/value heads: 2 Hkv/mp hd values for grouped-query attention, H/mp (qk + v) for multi-head latent
  attention (its keys and values are per head);
- ``LATENT``: multi-head latent attention's normalised latent and rotated RoPE key (DeepSeek-V2 sec. 2.1), r + rope
  values per token whatever the heads, which every rank expands through its own ``kv_b`` shard over the whole
  sequence (compiler/parallelize/latent_gather.py): kv_b's products then run on T rows, not T/cp.

For DeepSeek-V3 (H 128, qk 192, v 128, r 512, rope 64) the latent is 576 values a token against 40,960 for the keys
and values at mp 1 (5,120 at mp 8); only past mp 71 (H/mp (qk + v) < 576) would the keys and values be fewer.

FP8 runs (compiler/fp8/) gather keys and values: the latent path leaves each cp rank a partial sum of kv_b's output
gradient (its own queries' part), which FP8 would round on a grid of its own, where every operand FP8 quantizes in
this engine is a whole tensor on the one process's grid (tests/launches/test_parity_fp8.py's premise).

Fewer values is not always faster: the latent path runs kv_b over T rows, not T/cp. Where the gather is nearly free
(gloo between a CPU's local processes, ``runtime/lab/latent_cp_benchmark.py``) the keys and values win. So a plan says
what to gather (``ParallelPlan.cp_gather``, ``--cp-gather``): ``auto`` is the size rule above, ``latent`` and ``kv``
force a path (``latent`` only where the model has latent attention and the run is not FP8: ``cp_gather_problem``), and
the planner prices both where it may choose (compiler/planner/search.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from models import spec_of
from models.spec import LatentSizes

KV, LATENT = "kv", "latent"
AUTO = "auto"
CP_GATHERS = (AUTO, LATENT, KV)  # a plan's choices (ParallelPlan.cp_gather)


@dataclass(frozen=True)
class ContextGather:
    gathers: str  # KV or LATENT
    values_per_token: int  # values one rank gathers per token of the sequence, per attention layer, forward
    kv_values_per_token: int  # what gathering the keys and values would take (the fallback)

    def gathered_bytes(self, *, micro_batch_size: int, seq_len: int, itemsize: int) -> float:
        """Bytes of one attention layer's gathered tensors, forward, for one micro-batch: the whole sequence's
        values on every cp rank (each receives (cp - 1) / cp of them; the backward reduce-scatters as many)."""
        return micro_batch_size * seq_len * self.values_per_token * itemsize


def context_gather(latent: LatentSizes | None, *, kv_heads: int, head_dim: int, mp: int,
                   fp8: bool = False, choice: str = AUTO) -> ContextGather:
    """What a cp rank of an mp-way tensor-parallel attention gathers. ``choice`` ``auto``: the latent when the
    attention has one, the run is not ``fp8`` and it is fewer values per token than the rank's heads' keys and values
    (``kv_heads`` and ``head_dim``: grouped-query attention's sizes, unused with a latent); ``latent`` or ``kv``: that
    path (``latent`` where ``cp_gather_problem`` finds none)."""
    problem = cp_gather_problem(choice, latent_attention=latent is not None, fp8=fp8)
    if problem:
        raise ValueError(problem)
    if latent is None:
        kv = 2 * kv_heads // mp * head_dim
        return ContextGather(KV, kv, kv)
    kv = latent.n_heads // mp * (latent.qk_dim + latent.v_dim)
    compressed = latent.kv_lora_rank + latent.rope_dim  # replicated over mp: every TP rank gathers all of it
    gathers = LATENT if choice == LATENT or choice == AUTO and compressed < kv and not fp8 else KV
    return ContextGather(LATENT, compressed, kv) if gathers == LATENT else ContextGather(KV, kv, kv)


def cp_gather_problem(choice: str, *, latent_attention: bool, fp8: bool) -> str | None:
    """Why a run cannot gather ``choice`` (None: it can): the latent path needs latent attention and no FP8 (see the
    module's docstring); ``auto`` and ``kv`` run everywhere. One rule for train's check (runtime/config.py), the
    planner's search and the engine."""
    if choice not in CP_GATHERS:
        return f"--cp-gather must be one of {', '.join(CP_GATHERS)}, got {choice}"
    if choice != LATENT:
        return None
    if not latent_attention:
        return (f"--cp-gather {LATENT} needs multi-head latent attention (DeepSeek-V2/V3): this model has none; "
                f"use --cp-gather {AUTO} or {KV}")
    if fp8:
        return (f"--cp-gather {LATENT} cannot run with --fp8 (the latent path leaves kv_b partial gradients FP8 would "
                f"round on grids of their own); use --cp-gather {AUTO} or {KV}")
    return None


def context_gather_of(cfg, *, mp: int, fp8: bool = False, choice: str = AUTO) -> ContextGather:
    """``context_gather`` of a model config of any family (its spec's latent attention sizes, or its heads)."""
    latent = spec_of(cfg).latent_attention(cfg)
    if latent is not None:
        return context_gather(latent, kv_heads=latent.n_heads, head_dim=latent.qk_dim, mp=mp, fp8=fp8, choice=choice)
    return context_gather(None, kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, mp=mp, fp8=fp8, choice=choice)
