"""A plan, and what a user fixes of it.

A plan (``Candidate``) is the mesh (dp x pp x mp x cp ranks; ep borrows its ranks from dp x cp x mp), the
schedule and its stages per rank, the micro-batching, the precision, activation checkpointing (none,
selective or full), how data parallelism holds the state (FSDP, ZeRO-3, replicate, HSDP), sequence
parallelism and the chunked loss. ``Constraints`` are the parts a user gave (``run.py plan --dp ... --cp``):
the search holds them and chooses the rest.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

AC_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class Candidate:
    dp: int
    pp: int
    mp: int
    schedule: str
    stages_per_rank: int
    microbatches: int
    micro_batch_size: int
    precision: str
    activation_checkpointing: bool  # full: keep each block's input, recompute the block in backward
    dp_shard: int | None = None  # ranks a parameter is sharded over (None: dp, FSDP; 1: replicate; else HSDP)
    reshard_after_forward: bool = False  # ZeRO-3: gather parameters again for every micro-batch's backward
    sequence_parallel: bool = False  # norms and residual stream on sequence shards (mp > 1)
    cp: int = 1  # context parallelism: each sequence's tokens split over cp ranks
    ep: int = 1  # expert parallelism: experts split over ep ranks borrowed from dp x cp x mp
    selective_ac: bool = False  # keep matrix-product and attention outputs, recompute the rest
    chunked_loss: bool = False  # the vocabulary-parallel loss a chunk of tokens at a time

    @property
    def shard(self) -> int:
        return self.dp_shard or self.dp

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.mp * self.cp

    @property
    def ac(self) -> str:
        return "full" if self.activation_checkpointing else "selective" if self.selective_ac else "none"

    def flags(self) -> list[str]:
        """run.py flags that train exactly this plan (model flags are added by the caller)."""
        flags = ["--dp", str(self.dp), "--pp", str(self.pp), "--mp", str(self.mp), "--schedule", self.schedule,
                 "--stages-per-rank", str(self.stages_per_rank), "--microbatches", str(self.microbatches),
                 "--micro-batch-size", str(self.micro_batch_size), "--precision", self.precision]
        flags += ["--cp", str(self.cp)] if self.cp > 1 else []
        flags += ["--ep", str(self.ep)] if self.ep > 1 else []
        flags += ["--dp-shard", str(self.dp_shard)] if self.dp_shard is not None else []
        flags += ["--reshard-after-forward"] if self.reshard_after_forward else []
        flags += ["--sequence-parallel"] if self.sequence_parallel else []
        # The engine always computes the loss in chunks: no flag (runtime/config.py refuses plans without).
        return flags + {"full": ["--activation-checkpointing"], "selective": ["--activation-checkpointing", "selective"],
                        "none": []}[self.ac]

    def describe(self) -> str:
        ac = " +AC" if self.activation_checkpointing else " +SAC" if self.selective_ac else ""
        dp_mode = ""
        if self.dp > 1 and self.shard != self.dp:
            dp_mode = " replicate" if self.shard == 1 else f" hsdp={self.shard}"
        dp_mode += " zero3" if self.reshard_after_forward else ""
        dp_mode += " +SP" if self.sequence_parallel else ""
        dp_mode += " +chunked loss" if self.chunked_loss else ""
        extra = (f" cp={self.cp}" if self.cp > 1 else "") + (f" ep={self.ep}" if self.ep > 1 else "")
        return (f"{self.dp}x{self.pp}x{self.mp}{extra} {self.schedule} v={self.stages_per_rank} "
                f"m={self.microbatches} mbs={self.micro_batch_size} {self.precision}{ac}{dp_mode}")

    def to_dict(self) -> dict:
        return asdict(self)


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


def is_dp_mode(name: str) -> bool:
    """Whether ``name`` is a DP mode ``dp_mode`` can return: none, fsdp, zero3, replicate or hsdp:N."""
    return name in ("none", "fsdp", "zero3", "replicate") or (name.startswith("hsdp:") and name[5:].isdigit())


def dp_mode(c: Candidate) -> str:
    """The DP mode's name in plans and flags: none, fsdp, zero3, replicate or hsdp:N (cp ranks shard like dp
    ranks: at dp 1 and cp > 1, fsdp or zero3)."""
    return dp_mode_name(c.dp, c.cp, c.dp_shard, c.reshard_after_forward)


def dp_mode_name(dp: int, cp: int, dp_shard: int | None, reshard_after_forward: bool) -> str:
    """``dp_mode`` of a plan with these fields (``dp_modes`` gives the (dp_shard, reshard) pairs)."""
    if dp == 1:
        return ("zero3" if reshard_after_forward else "fsdp") if cp > 1 else "none"
    shard = dp_shard or dp
    if shard == dp:
        return "zero3" if reshard_after_forward else "fsdp"
    return "replicate" if shard == 1 else f"hsdp:{shard}"


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
    max_mp: int | None = None  # default: a node's devices
    max_cp: int | None = None  # default: compiler/planner/search.py ``default_max_cp``
    max_ep: int | None = None
    headroom: float = 0.0  # fraction of a device's memory left free

    def schedules(self) -> tuple[str, ...] | None:
        """The schedules admitted (None: any)."""
        return (self.schedule,) if isinstance(self.schedule, str) else self.schedule

    def admits(self, c: Candidate) -> bool:
        if self.schedule is not None and c.schedule not in self.schedules():
            return False
        return all(want is None or want == got for want, got in (
            (self.dp, c.dp), (self.pp, c.pp), (self.mp, c.mp), (self.cp, c.cp), (self.ep, c.ep),
            (self.micro_batch_size, c.micro_batch_size), (self.stages_per_rank, c.stages_per_rank),
            (self.ac, c.ac), (self.dp_mode, dp_mode(c)), (self.sequence_parallel, c.sequence_parallel),
            (self.chunked_loss, c.chunked_loss), (self.precision, c.precision)))

    def fixes_layout(self) -> bool:
        """The user named a layout to price (any of the plan's own fields)."""
        names = {f.name for f in fields(self)} - {"max_mp", "max_cp", "max_ep", "headroom", "ac_modes"}
        return any(getattr(self, n) is not None for n in names)
