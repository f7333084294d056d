"""The plan space: every (dp, pp, mp) of a world size with a schedule, v, micro-batching, precision, AC and
DP mode."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from compiler.schedules import SCHEDULES

# (schedule, v) pairs the planner considers, in the registry's order of preference.
SCHEDULE_CHOICES = tuple((name, v) for name, spec in SCHEDULES.items() for v in spec.planner_v)


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
    activation_checkpointing: bool
    dp_shard: int | None = None  # ranks a parameter is sharded over (None: dp, FSDP; 1: replicate; else HSDP)
    reshard_after_forward: bool = False  # ZeRO-3: gather parameters again for every micro-batch's backward
    sequence_parallel: bool = False  # norms and residual stream on sequence shards (mp > 1)
    # With activation_checkpointing: keep matrix products and attention outputs, recompute the rest.
    selective_checkpointing: bool = False

    @property
    def shard(self) -> int:
        return self.dp_shard or self.dp

    @property
    def ac_mode(self) -> str:
        """--activation-checkpointing's value: "none", "full" or "selective"."""
        if not self.activation_checkpointing:
            return "none"
        return "selective" if self.selective_checkpointing else "full"

    def flags(self) -> list[str]:
        """run.py flags that train exactly this plan (model flags are added by the caller)."""
        flags = ["--dp", str(self.dp), "--pp", str(self.pp), "--mp", str(self.mp), "--schedule", self.schedule,
                 "--stages-per-rank", str(self.stages_per_rank), "--microbatches", str(self.microbatches),
                 "--micro-batch-size", str(self.micro_batch_size), "--precision", self.precision]
        flags += ["--dp-shard", str(self.dp_shard)] if self.dp_shard is not None else []
        flags += ["--reshard-after-forward"] if self.reshard_after_forward else []
        flags += ["--sequence-parallel"] if self.sequence_parallel else []
        return flags + {"none": [], "full": ["--activation-checkpointing"],
                        "selective": ["--activation-checkpointing", "selective"]}[self.ac_mode]

    def describe(self) -> str:
        ac = {"none": "", "full": " +AC", "selective": " +SAC"}[self.ac_mode]
        dp_mode = ""
        if self.dp > 1 and self.shard != self.dp:
            dp_mode = " replicate" if self.shard == 1 else f" hsdp={self.shard}"
        dp_mode += " zero3" if self.reshard_after_forward else ""
        dp_mode += " +SP" if self.sequence_parallel else ""
        return (f"{self.dp}x{self.pp}x{self.mp} {self.schedule} v={self.stages_per_rank} "
                f"m={self.microbatches} mbs={self.micro_batch_size} {self.precision}{ac}{dp_mode}")

    def to_dict(self) -> dict:
        return asdict(self)


def meshes(world: int) -> list[tuple[int, int, int]]:
    return [(dp, pp, world // (dp * pp)) for dp in range(1, world + 1) if world % dp == 0
            for pp in range(1, world // dp + 1) if (world // dp) % pp == 0]


def dp_modes(dp: int) -> list[tuple[int | None, bool]]:
    """(dp_shard, reshard_after_forward) choices for dp ranks: FSDP, ZeRO-3, replicate, and HSDP over each
    proper divisor of dp greater than one."""
    if dp == 1:
        return [(None, False)]
    return [(None, False), (None, True), (1, False), *((s, False) for s in range(2, dp) if dp % s == 0)]


def candidates(world: int, *, global_batch_size: int, precisions: tuple[str, ...],
               activation_checkpointing: tuple[bool, ...] = (False, True)) -> list[Candidate]:
    out = []
    for dp, pp, mp in meshes(world):
        if global_batch_size % dp:
            continue
        per_replica = global_batch_size // dp
        schedules = SCHEDULE_CHOICES if pp > 1 else (("1f1b", 1),)  # without a pipeline they coincide
        for schedule, v in schedules:
            for mbs in (b for b in range(1, per_replica + 1) if per_replica % b == 0):
                for precision in precisions:
                    for ac in activation_checkpointing:
                        for shard, zero3 in dp_modes(dp):
                            out.append(Candidate(dp, pp, mp, schedule, v, per_replica // mbs, mbs, precision, ac,
                                                 dp_shard=shard, reshard_after_forward=zero3))
    return out


@dataclass(frozen=True)
class Constraints:
    """What the user fixed (``run.py plan --dp --pp --mp ...``); None leaves it to the search."""
    dp: int | None = None
    pp: int | None = None
    mp: int | None = None
    micro_batch_size: int | None = None
    schedule: str | tuple[str, ...] | None = None  # one schedule, or any of several
    stages_per_rank: int | None = None
    activation_checkpointing: bool | None = None
    dp_mode: str | None = None  # "none" | "fsdp" | "zero3" | "replicate" | "hsdp:N" (compiler/planner/candidates.dp_mode)

    def admits(self, c: Candidate) -> bool:
        if self.schedule is not None and c.schedule not in ((self.schedule,) if isinstance(self.schedule, str)
                                                            else self.schedule):
            return False
        return all(want is None or want == got for want, got in (
            (self.dp, c.dp), (self.pp, c.pp), (self.mp, c.mp), (self.micro_batch_size, c.micro_batch_size),
            (self.stages_per_rank, c.stages_per_rank),
            (self.activation_checkpointing, c.activation_checkpointing), (self.dp_mode, dp_mode(c))))


def dp_mode(c: Candidate) -> str:
    """The DP mode's name in plans and flags: none, fsdp, zero3, replicate or hsdp:N."""
    if c.dp == 1:
        return "none"
    if c.shard == c.dp:
        return "zero3" if c.reshard_after_forward else "fsdp"
    return "replicate" if c.shard == 1 else f"hsdp:{c.shard}"
