"""One table from flags to a ``ParallelPlan``'s fields (compiler/parallel_plan.py), read both ways: argparse
definitions for ``train``, ``eval`` and ``plan`` (``add_plan_flags``), and a plan back to the flags that train it
(``plan_flags``, for launching runs). Error messages name a field's flag through ``FLAG_OF``.

``run.py plan`` takes the same flags with no defaults: a flag left out is searched (``searched=True``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

from compiler.context_gather import CP_GATHERS
from compiler.fp8 import RECIPES
from compiler.parallel_plan import AC, AC_MODES, DEFAULT_SCHEDULE, ParallelPlan
from compiler.precisions import PRECISIONS
from compiler.schedules import SCHEDULES

FP8_ANY = "any"  # --fp8 any: the planner chooses a recipe (or none)


@dataclass(frozen=True)
class PlanFlag:
    field: str  # the ParallelPlan field
    flag: str
    default: Any  # training's default (None: derived, e.g. v from the schedule)
    help: str
    type: Callable | None = int
    choices: tuple[str, ...] | None = None
    switch: bool = False  # a flag without a value (True when given)

    def text(self, value: Any) -> list[str]:
        """The flag text that sets ``value`` (nothing at the default of a switch)."""
        if self.switch:
            return [self.flag] if value else []
        return [self.flag, str(value)]


PLAN_FLAGS: tuple[PlanFlag, ...] = (
    PlanFlag("dp", "--dp", 1, "data-parallel degree (FSDP replicas)"),
    PlanFlag("pp", "--pp", 1, "pipeline-parallel degree (ranks per pipeline)"),
    PlanFlag("mp", "--mp", 1, "model (tensor) parallel degree"),
    PlanFlag("cp", "--cp", 1, "context-parallel degree: each sequence is split over N ranks (2N load-balanced chunks, "
             "rank c keeping chunks c and 2N-1-c; attention all-gathers keys and values); dp x pp x cp x mp ranks"),
    PlanFlag("cp_gather", "--cp-gather", "auto", "what --cp gathers for multi-head latent attention (DeepSeek-V2/V3): "
             "latent = its normalised latent and RoPE key (r + rope values a token), each rank expanding the whole "
             "sequence through its kv_b; kv = the keys and values (H/mp (qk + v) values a token); auto = the latent "
             "where it is fewer values and the run is not FP8 (compiler/context_gather.py). latent needs latent "
             "attention and no --fp8; --auto and run.py plan price both unless this flag holds one",
             type=None, choices=CP_GATHERS),
    PlanFlag("ep", "--ep", 1, "expert-parallel degree for mixture-of-experts models, borrowed from --dp: groups of N "
             "replicas each hold 1/N of every MoE layer's experts and exchange tokens all-to-all (N divides --dp and "
             "the expert count)"),
    PlanFlag("schedule", "--schedule", DEFAULT_SCHEDULE, "pipeline schedule; naive = stop-and-wait, one micro-batch "
             "at a time", type=None, choices=tuple(SCHEDULES)),
    PlanFlag("stages_per_rank", "--stages-per-rank", None, "virtual stages v per pp rank (default: the schedule's, "
             "e.g. 2 for interleaved-1f1b, when pp > 1; else 1)"),
    PlanFlag("microbatches", "--microbatches", None, "micro-batches per step per dp replica (default: global batch / "
             "(micro-batch size x dp), or 2 x pp)"),
    PlanFlag("micro_batch_size", "--micro-batch-size", 4, "samples per micro-batch"),
    PlanFlag("precision", "--precision", None, "; ".join(f"{p.name} = {p.description}" for p in PRECISIONS.values())
             + ". Default: bf16 where the device computes it fast (CUDA compute capability >= 8.0, a CPU with AVX-512 "
             "BF16 or AMX), else fp32. fp32 on CUDA computes matrix products in TF32 (runtime/device.py)",
             type=None, choices=tuple(PRECISIONS)),
    PlanFlag("fp8", "--fp8", None, "run the attention, MLP and expert matrix products in FP8 on top of --precision "
             "(the embedding, LM head, routers and norms stay in it), scales over each whole tensor on any mesh: "
             + "; ".join(f"{r.name} = {r.description}" for r in RECIPES.values())
             + f"; {FP8_ANY} = let --auto (or run.py plan) choose a recipe or none", type=None,
             choices=(*RECIPES, FP8_ANY)),
    PlanFlag("fp8_all_gather", "--fp8-all-gather", False, "with --fp8 tensorwise and sharded data parallelism "
             "(FSDP, HSDP, ZeRO-3): FSDP all-gathers the FP8 linears' weights as e4m3 bytes quantized with each whole "
             "weight's scale (one all-reduce of every weight's amax per step), half of a bf16 gather's bytes; the "
             "products are the same as without it", switch=True),
    PlanFlag("ac", "--activation-checkpointing", AC.NONE.value, "recompute in the backward pass to save activation "
             "memory: full (also the flag alone) keeps only each transformer block's input; selective keeps its matrix "
             "products' and attention's outputs and recomputes the rest (norms, activations, RoPE: little compute)",
             type=None, choices=AC_MODES),
    PlanFlag("dp_shard", "--dp-shard", None, "ranks a parameter is sharded over, a divisor of --dp (default --dp: "
             "FSDP); 1 = replicate (every rank holds the whole stage, gradients all-reduced, like DDP); between: HSDP, "
             "sharded within groups of N replicas and replicated across them; with --cp each group spans its cp ranks "
             "too (at --dp 1 the cp ranks shard)"),
    PlanFlag("reshard_after_forward", "--reshard-after-forward", False, "free gathered parameters after each forward "
             "and gather them again for backward (ZeRO-3 memory, one more all-gather per micro-batch); default: keep "
             "them gathered for the step", switch=True),
    PlanFlag("reduce_dtype", "--reduce-dtype", "fp32", "precision in which data-parallel gradients are communicated "
             "(FSDP MixedPrecisionPolicy); parameters and optimizer state stay fp32", type=None,
             choices=tuple(PRECISIONS)),
    PlanFlag("sequence_parallel", "--sequence-parallel", False, "with --mp > 1: run the norms and keep the residual "
             "stream on sequence shards (T/mp per rank; Korthikanti et al. 2022), all-gathering before and "
             "reduce-scattering after each tensor-parallel region instead of all-reducing", switch=True),
    PlanFlag("split", "--split", "auto", "stage split: auto (balance estimated per-layer cost), uniform (equal blocks "
             "per stage), or manual:N0,N1,... (blocks per stage)", type=None),
)
FLAG: dict[str, PlanFlag] = {f.field: f for f in PLAN_FLAGS}
FLAG_OF: dict[str, str] = {f.field: f.flag for f in PLAN_FLAGS}
# The fields ``--auto`` chooses (the planner's plan): giving one of their flags with --auto is an error.
AUTO_CHOSEN_FIELDS = ("dp", "pp", "mp", "dp_shard", "reshard_after_forward", "schedule", "stages_per_rank",
                      "microbatches", "micro_batch_size", "ac")


def add_plan_flags(group: argparse._ActionsContainer, fields: tuple[str, ...], *, searched: bool = False) -> None:
    """Add these fields' flags to ``group``. ``searched``: no defaults, a flag left out is None (``run.py plan``
    searches it), and every switch can also be held off (``--no-sequence-parallel``)."""
    for name in fields:
        f = FLAG[name]
        default = None if searched else f.default
        if f.switch:
            action = argparse.BooleanOptionalAction if searched else "store_true"
            group.add_argument(f.flag, dest=f.field, action=action, default=default, help=f.help)
        elif f.field == "ac":  # the bare flag means full
            group.add_argument(f.flag, dest=f.field, nargs="?", const=AC.FULL.value, default=default,
                               choices=f.choices, help=f.help)
        else:
            group.add_argument(f.flag, dest=f.field, type=f.type, choices=f.choices, default=default, help=f.help)


def fp8_choices(flag: str | None) -> tuple[str | None, ...]:
    """The recipes a plan search may choose for --fp8 (None: no FP8): none without the flag, the one named, or any
    recipe or none with ``--fp8 any``."""
    if flag is None:
        return (None,)
    return (None, *RECIPES) if flag == FP8_ANY else (flag,)


def plan_flags(plan: ParallelPlan) -> list[str]:
    """run.py flags that train exactly ``plan`` (model flags are the caller's). A field at the value the engine
    takes without its flag is left out (cp, ep at 1, DP mode FSDP, reduce in fp32, the automatic split, no FP8, the
    size rule's CP gather)."""
    implied = {"cp": 1, "ep": 1, "dp_shard": None, "reduce_dtype": "fp32", "split": "auto", "ac": AC.NONE, "fp8": None,
               "fp8_all_gather": False, "cp_gather": "auto"}
    out: list[str] = []
    for f in PLAN_FLAGS:
        value = getattr(plan, f.field)
        if f.field in implied and value == implied[f.field]:
            continue
        out += f.text(value.value if isinstance(value, AC) else value)
    return out
