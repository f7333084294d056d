"""The plan space's axes (meshes, DP modes) and what a user fixes of a plan.

A plan is a ``ParallelPlan`` (compiler/parallel_plan.py). ``Constraints`` are the parts a user gave
(``run.py plan --dp ... --cp``): the search holds them and chooses the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from compiler.parallel_plan import ParallelPlan


def meshes(world: int) -> list[tuple[int, int, int]]:
    """(dp, pp, mp) with dp x pp x mp = ``world`` (the engine's meshes; ``mesh_shapes`` adds cp)."""
    return [(dp, pp, world // (dp * pp)) for dp in range(1, world + 1) if world % dp == 0
            for pp in range(1, world // dp + 1) if (world // dp) % pp == 0]


def mesh_shapes(world: int, *, max_cp: int = 1) -> list[tuple[int, int, int, int]]:
    """(dp, pp, mp, cp) with dp x pp x mp x cp = ``world`` and cp <= ``max_cp``."""
    return [(dp, pp, mp, cp) for cp in range(1, min(max_cp, world) + 1) if world % cp == 0
            for dp, pp, mp in meshes(world // cp)]


def hsdp_shards(dp: int, *, per_node: int) -> list[int]:
    """HSDP's shard sizes: every proper divisor of a small dp; of a large one the powers of two and a node's members."""
    if dp <= 16:
        return [s for s in range(2, dp) if dp % s == 0]
    return sorted({s for s in (per_node, *(2 ** i for i in range(1, 9))) if 1 < s < dp and dp % s == 0})


def dp_modes(dp: int, *, cp: int = 1, per_node: int = 8) -> list[tuple[int | None, bool]]:
    """(dp_shard, reshard_after_forward): FSDP, ZeRO-3, replicate and HSDP. At dp 1 the parameters are still
    sharded over cp ranks (FSDP over dp x cp), with or without resharding after the forward."""
    if dp == 1:
        return [(None, False), (None, True)] if cp > 1 else [(None, False)]
    return [(None, False), (None, True), (1, False), *((s, False) for s in hsdp_shards(dp, per_node=per_node))]


def mesh_misfit(sizes: dict[str, int], world: int) -> int | None:
    """The product of the mesh sizes a layout fixes when they cannot fill ``world`` ranks, else None: all four
    (dp, pp, mp, cp) must multiply to it; fewer must divide it (the dimension left out is searched)."""
    product = 1
    for n in sizes.values():
        product *= n
    return product if ((product != world) if len(sizes) == 4 else (world % product)) else None


@dataclass(frozen=True)
class Constraints:
    """What the user fixed (``run.py plan --dp --pp --mp --cp --ep ...``); None leaves it to the search.
    ``max_*`` bound the dimensions the search tries; ``headroom`` keeps a fraction of device memory free."""
    dp: int | None = None
    pp: int | None = None
    mp: int | None = None
    cp: int | None = None
    ep: int | None = None
    micro_batch_size: int | None = None
    schedule: str | tuple[str, ...] | None = None  # one schedule, or any of several
    stages_per_rank: int | None = None
    ac: str | None = None  # "none" | "selective" | "full"
    ac_modes: tuple[str, ...] | None = None  # the AC modes the search tries (default: all three)
    dp_mode: str | None = None  # "none" | "fsdp" | "zero3" | "replicate" | "hsdp:N"
    sequence_parallel: bool | None = None
    chunked_loss: bool | None = None
    precision: str | None = None
    # The FP8 recipes the search may choose, None for none: FP8 is planned only when asked (--fp8 X, --fp8 any).
    fp8: tuple[str | None, ...] = (None,)
    # --fp8-all-gather's choices: held on or off by the flag, else either where the engine runs it (tensorwise FP8,
    # sharded data parallelism): it leaves the products' numbers as they are, so it is the search's like a DP mode.
    fp8_all_gather: tuple[bool, ...] = (False, True)
    # --cp-gather's choices (compiler/context_gather.py): held by the flag, else (None) latent and kv both priced
    # where the model has latent attention, cp > 1 and no FP8 (auto elsewhere): fewer values is not always faster.
    cp_gather: tuple[str, ...] | None = None
    max_mp: int | None = None  # default: a node's devices
    max_cp: int | None = None  # default: compiler/planner/search.py ``default_max_cp``
    max_ep: int | None = None
    headroom: float = 0.0  # fraction of a device's memory left free

    def schedules(self) -> tuple[str, ...] | None:
        """The schedules admitted (None: any)."""
        return (self.schedule,) if isinstance(self.schedule, str) else self.schedule

    def admits(self, c: ParallelPlan) -> bool:
        if self.schedule is not None and c.schedule not in self.schedules() or c.fp8 not in self.fp8:
            return False
        if c.fp8_all_gather not in self.fp8_all_gather or self.cp_gather is not None and c.cp_gather not in self.cp_gather:
            return False
        return all(want is None or want == got for want, got in (
            (self.dp, c.dp), (self.pp, c.pp), (self.mp, c.mp), (self.cp, c.cp), (self.ep, c.ep),
            (self.micro_batch_size, c.micro_batch_size), (self.stages_per_rank, c.stages_per_rank),
            (self.ac, c.ac), (self.dp_mode, c.dp_mode), (self.sequence_parallel, c.sequence_parallel),
            (self.chunked_loss, c.chunked_loss), (self.precision, c.precision)))

    def fixes_layout(self) -> bool:
        """The user named a layout to price (any of the plan's own fields)."""
        names = {f.name for f in fields(self)} - {"max_mp", "max_cp", "max_ep", "headroom", "ac_modes", "fp8",
                                                 "fp8_all_gather", "cp_gather"}
        return any(getattr(self, n) is not None for n in names)
