"""Which runs the study makes: pure functions from (world size, settings) to run specifications."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from compiler.precisions import PRECISIONS as PRECISION_REGISTRY
from models import named_config
from runtime.commands.flags import model_flags
from runtime.commands.launch import RunSpec
from runtime.lab.plain_loop import plain_flags
from runtime.lab.study.checkpointing import CheckpointBench

# Schedules of the throughput section: (label, --schedule, virtual stages v).
THROUGHPUT_SCHEDULES = (
    ("naive", "naive", 1), ("gpipe", "gpipe", 1), ("1f1b", "1f1b", 1),
    ("interleaved-1f1b v=2", "interleaved-1f1b", 2), ("interleaved-1f1b v=4", "interleaved-1f1b", 4),
    ("zero-bubble", "zero-bubble", 2), ("zbv", "zbv", 2), ("dualpipev", "dualpipev", 2),
    ("looped-bfs v=2", "looped-bfs", 2),
)
# Meshes of the throughput section: (group, dp, pp, mp).
THROUGHPUT_MESHES = (("pp=2", 1, 2, 1), ("pp=4", 1, 4, 1), ("3D 2x2x2", 2, 2, 2))
PRECISIONS = tuple(PRECISION_REGISTRY)  # fp32 first: the batch search compares against it


def model_summary(cfg) -> dict:
    """What results.json and the report print of a model: its family and sizes."""
    return {"family": cfg.family, "layers": cfg.n_layers, "d_model": cfg.d_model, "heads": cfg.n_heads,
            "kv_heads": cfg.n_kv_heads, "seq_len": cfg.seq_len, "vocab_size": cfg.vocab_size}


@dataclass(frozen=True)
class StudySettings:
    # The models are family configs (a --model size with overrides; runs get their flags from
    # runtime/commands/flags.py model_flags). Those the plain PyTorch loop trains too (the throughput model,
    # the replicate benchmark's) are GPT-2 by the tiny size's rules, what runtime/lab/plain_loop.py builds.
    model: Any  # throughput, time split, timelines, scaling, overhead
    micro_batch_size: int
    microbatches: int
    steps: int
    rounds: int  # repetitions of the pp=2 throughput runs and of the overhead pair (noise)
    memory_model: Any
    split_model: Any  # an LM head as heavy as several blocks, for --split auto vs uniform
    memory_budget_gb: float  # per rank, in peak tensor bytes
    memory_resolution: float  # bisection stops when (fail - fit) <= resolution * fit
    memory_start: int  # first micro-batch tried (then doubled)
    timeout_s: float
    # What to cover (the smoke mode trims these; full and quick cover everything the world allows).
    throughput_schedules: tuple[str, ...] = tuple(label for label, _, _ in THROUGHPUT_SCHEDULES)
    throughput_world: int = 8  # the largest throughput group run (pp=2: 2 ranks, pp=4: 4, 3D 2x2x2: 8)
    scaling_worlds: tuple[int, ...] = (1, 2, 4, 8)
    overhead_pairs: int = 4  # alternated engine / plain-loop pairs
    split_pps: tuple[int, ...] = (2, 4)
    # Micro-batching of the split benchmark (None: the study's). It trains the same global batch in more,
    # smaller micro-batches so that the steady state, where the busiest stage sets the pace, dominates the
    # fill and drain that every split pays alike (m >= 4 x pp, as Megatron-LM advises).
    split_microbatches: int | None = None
    split_micro_batch_size: int | None = None
    # Memory per configuration (study/sharding.py) and the replicate-vs-DDP benchmark.
    sharding_model: Any = named_config("tiny")
    sharding_large: bool = False  # add GPT-2 Large at 2x2x2
    sharding_other_shapes: bool = False  # add the Llama 3 shape and GPT-2 small at T 1024, with and without SP
    sharding_world: int = 8  # the most ranks a row of the section uses (its rows: study/sharding.py)
    replicate_model: Any = named_config("tiny", n_layers=2, d_model=32, n_heads=2, seq_len=32)
    replicate_rounds: int = 1
    # ZB-V against the naive loop at pp=2 (study/zero_bubble.py); 4 blocks at least (4 stages).
    zero_bubble_model: Any = named_config("tiny", n_layers=4, d_model=32, n_heads=2, seq_len=32)
    zero_bubble_rounds: int = 1
    zero_bubble_compiled: bool = True  # also interleaved v=2 with --compile (the smoke study skips inductor)
    zero_bubble_1f1b: bool = True  # also 1f1b (--quick and --smoke time it in the throughput section only)
    # Schedules of the split section: the looped 1F1B and the V-shaped ZB-V (its own V-aware split).
    split_schedules: tuple[str, ...] = ("1f1b", "zbv")
    # A mixture of experts at ep 1, 2, 4 and its load balance (study/experts.py): 0 repetitions skip it.
    experts_rounds: int = 0
    experts_steps: int = 6
    experts_balance_steps: int = 0
    # Long sequences (study/long_context.py): the cp rows' sequence length; 0 skips the section.
    long_context_seq_len: int = 0
    # ... and the longest T checked by a run: each cp group trains one step at the memory model's longest T
    # within 20 GiB, capped here (a step's attention grows as T squared: at T 32,768 it takes minutes on 2 cores).
    long_context_longest_cap: int = 0
    # Checkpoint pauses, foreground and background, and steady memory (study/checkpointing.py).
    checkpoint_bench: CheckpointBench = CheckpointBench(
        model=named_config("tiny", n_layers=4, d_model=32, n_heads=2, seq_len=32), steps=4, every=2, rounds=1,
        modes=("foreground", "background"), steady_steps=None, max_world=2)


FULL = StudySettings(
    model=named_config("tiny", n_layers=16, d_model=384, n_heads=8, seq_len=128),
    micro_batch_size=4, microbatches=8, steps=5, rounds=2,
    memory_model=named_config("tiny", n_layers=8, d_model=64, n_heads=4, seq_len=256),
    memory_budget_gb=0.4, memory_resolution=1 / 8, memory_start=16,
    # The split model's vocabulary (the range is 16k-32k) sets how heavy the head is. At 32k the
    # head with its loss takes ~13 blocks' time on this CPU (its 32 MiB weight leaves the cache), and with
    # the head alone as the busiest stage no split can beat (2 blocks + head) / head = 1.15x at pp=4. At
    # 28k it takes ~9 blocks, close to the other 8 blocks together: the split where balance matters most,
    # on 2 cores (head | the rest) as with a core per rank.
    split_model=named_config("tiny", n_layers=8, d_model=256, n_heads=4, seq_len=128, vocab_size=28672),
    timeout_s=900, overhead_pairs=3, split_microbatches=16, split_micro_batch_size=2,
    sharding_model=named_config("small", seq_len=128), sharding_large=True, sharding_other_shapes=True,
    replicate_model=named_config("tiny", n_layers=8, d_model=256, n_heads=4, seq_len=128), replicate_rounds=3,
    zero_bubble_model=named_config("tiny", n_layers=8, d_model=256, n_heads=4, seq_len=128), zero_bubble_rounds=3,
    experts_rounds=2, experts_steps=8, experts_balance_steps=100, long_context_seq_len=8192,
    long_context_longest_cap=32768,
    checkpoint_bench=CheckpointBench(
        model=named_config("tiny", n_layers=8, d_model=512, n_heads=8, seq_len=32, vocab_size=8192), steps=16, every=4,
        rounds=2, modes=("none", "foreground", "background"), steady_steps=300),
)
# A smaller model, one repetition, fewer schedules and a coarse memory search: every section in ~10 minutes.
# Fixed per-action costs dominate this model, so its speed-ups are not the targets' numbers.
QUICK = StudySettings(
    model=named_config("tiny", n_layers=8, d_model=128, n_heads=8, seq_len=64),
    micro_batch_size=2, microbatches=8, steps=4, rounds=1,
    memory_model=named_config("tiny", n_layers=4, d_model=64, n_heads=4, seq_len=128),
    memory_budget_gb=0.04, memory_resolution=1 / 4, memory_start=4,
    split_model=named_config("tiny", n_layers=8, d_model=128, n_heads=4, seq_len=64, vocab_size=16384),
    timeout_s=300, overhead_pairs=2,
    # The schedules the targets and timelines name, throughput and scaling up to 4 ranks (8 ranks on 2 cores
    # spend most of a short run starting up), the sharding section's 4-rank rows (every DP mode and a 3D
    # mesh against replication) and no inductor row: the 8-rank sharding rows with the Llama shape, the 3D
    # throughput group and the compiled row had made it the longest section.
    throughput_schedules=("naive", "1f1b", "interleaved-1f1b v=2", "zbv"), scaling_worlds=(1, 2, 4),
    throughput_world=4, zero_bubble_compiled=False, zero_bubble_1f1b=False, sharding_world=4,
    replicate_model=named_config("tiny", n_layers=4, d_model=128, n_heads=4, seq_len=64), replicate_rounds=2,
    zero_bubble_model=named_config("tiny", n_layers=8, d_model=128, n_heads=8, seq_len=64),
    experts_rounds=1, experts_steps=5, experts_balance_steps=40, long_context_seq_len=2048,
    checkpoint_bench=CheckpointBench(
        model=named_config("tiny", n_layers=4, d_model=256, n_heads=4, seq_len=32, vocab_size=4096), steps=8, every=4,
        rounds=1, modes=("none", "foreground", "background"), steady_steps=None),
)
# The smallest study that still exercises every section and file (the test suite runs it): the
# schedules the timelines need, pp=2 and pp=4, meshes up to 2 ranks for scaling, one overhead pair
# and a two-trial memory search per precision. Its numbers mean nothing.
SMOKE = StudySettings(
    model=named_config("tiny", n_layers=8, d_model=128, n_heads=8, seq_len=64),
    micro_batch_size=4, microbatches=4, steps=3, rounds=1,
    memory_model=named_config("tiny", n_layers=2, d_model=32, n_heads=2, seq_len=32),
    memory_budget_gb=0.002, memory_resolution=1.0, memory_start=8,
    split_model=named_config("tiny", n_layers=4, d_model=64, n_heads=4, seq_len=32, vocab_size=2048), timeout_s=300,
    throughput_schedules=("naive", "1f1b", "interleaved-1f1b v=2"), scaling_worlds=(1, 2), overhead_pairs=1,
    split_pps=(2,), split_schedules=("1f1b",), zero_bubble_compiled=False, zero_bubble_1f1b=False,
)


def run_key(spec: RunSpec) -> tuple:
    """What a run measures: specs with the same key are the same measurement, run once and shared by the
    sections that need it. Repetitions of a configuration (meta "round") are distinct measurements."""
    return spec.kind, spec.nproc, tuple(spec.args), spec.meta.get("round", 0)


def _common(s: StudySettings, steps: int | None = None, precision: str = "fp32") -> list[str]:
    steps = steps or s.steps
    return ["--data", "synthetic", "--precision", precision, "--steps", str(steps), "--log-every", str(steps),
            "--eval-every", "0", "--eval-batches", "1", "--seed", "1234"]


def _mesh(dp: int, pp: int, mp: int) -> list[str]:
    return ["--dp", str(dp), "--pp", str(pp), "--mp", str(mp)]


def _steps(world: int, s: StudySettings) -> int:
    # 8 ranks on this machine's cores take ~3x longer per step: one step fewer.
    return s.steps - 1 if world > 4 else s.steps


def throughput_specs(world: int, s: StudySettings) -> list[RunSpec]:
    specs = []
    for group, dp, pp, mp in THROUGHPUT_MESHES:
        if dp * pp * mp > min(world, s.throughput_world):
            continue
        # Every group trains the same global batch (m micro-batches per replica): dp replicas split it.
        mbs = max(1, s.micro_batch_size // dp)
        rounds = s.rounds if group == "pp=2" else 1
        for r in range(rounds):
            order = THROUGHPUT_SCHEDULES if r % 2 == 0 else THROUGHPUT_SCHEDULES[::-1]  # alternate against drift
            for label, schedule, v in order:
                if label not in s.throughput_schedules:
                    continue
                meta = {"section": "throughput", "group": group, "label": label, "schedule": schedule,
                        "dp": dp, "pp": pp, "mp": mp, "v": v, "m": s.microbatches, "micro_batch_size": mbs, "round": r}
                if s.model.n_layers < pp * v:
                    meta["skipped"] = f"needs >= {pp * v} layers for pp={pp} x v={v}, model has {s.model.n_layers}"
                args = [*_mesh(dp, pp, mp), "--schedule", schedule, "--stages-per-rank", str(v),
                        "--micro-batch-size", str(mbs), "--microbatches", str(s.microbatches),
                        *model_flags(s.model), *_common(s, _steps(dp * pp * mp, s)), "--profile"]
                name = f"throughput_{group.replace(' ', '_').replace('=', '')}_{label.replace(' ', '_').replace('=', '')}_r{r}"
                specs.append(RunSpec(name, dp * pp * mp, args, meta=meta))
    return specs


def scaling_meshes(world: int) -> list[tuple[str, int, int, int]]:
    """(kind, dp, pp, mp) for 1, 2, 4, 8 ranks up to ``world``: DP only, PP only, MP only and the mixes."""
    meshes = [("single", 1, 1, 1)]
    for n in (2, 4, 8):
        if n > world:
            break
        meshes += [("DP", n, 1, 1), ("PP", 1, n, 1), ("MP", 1, 1, n)]
    if world >= 4:
        meshes += [("mix", 2, 2, 1), ("mix", 2, 1, 2), ("mix", 1, 2, 2)]
    if world >= 8:
        meshes.append(("3D", 2, 2, 2))
    return meshes


def _scaling_batching(global_batch: int, dp: int, pp: int, s: StudySettings) -> tuple[int, int]:
    """(micro-batch size, micro-batches) for a scaling mesh. A pipeline keeps the throughput section's
    micro-batch count (its bubble depends on it; 3D then matches, and shares, the throughput run); without
    a pipeline micro-batches are only gradient accumulation, so the micro-batch stays as large as it can."""
    if pp > 1 and global_batch % (s.microbatches * dp) == 0:
        return global_batch // (s.microbatches * dp), s.microbatches
    return s.micro_batch_size, global_batch // (s.micro_batch_size * dp)


def scaling_specs(world: int, s: StudySettings) -> list[RunSpec]:
    """Strong scaling: the same global batch (micro-batch size x microbatches) on every mesh."""
    specs = []
    global_batch = s.micro_batch_size * s.microbatches
    for kind, dp, pp, mp in scaling_meshes(min(world, max(s.scaling_worlds))):
        mbs, m = _scaling_batching(global_batch, dp, pp, s)
        v = 2 if pp > 1 and s.model.n_layers >= 2 * pp and m % pp == 0 else 1
        args = [*_mesh(dp, pp, mp), "--schedule", "interleaved-1f1b", "--stages-per-rank", str(v),
                "--micro-batch-size", str(mbs), "--microbatches", str(m),
                *model_flags(s.model), *_common(s, _steps(dp * pp * mp, s)), "--profile"]
        meta = {"section": "scaling", "kind": kind, "dp": dp, "pp": pp, "mp": mp, "world": dp * pp * mp, "v": v, "m": m}
        specs.append(RunSpec(f"scaling_{kind}_{dp}x{pp}x{mp}", dp * pp * mp, args, meta=meta))
    return specs


def overhead_specs(s: StudySettings) -> list[RunSpec]:
    """The engine at 1x1x1 next to a plain PyTorch loop, alternated ``rounds`` times."""
    batching = ["--micro-batch-size", str(s.micro_batch_size), "--microbatches", str(s.microbatches)]
    plain_args = [*plain_flags(s.model), *batching, "--steps", str(s.steps + 1), "--precision", "fp32"]
    engine_args = [*_mesh(1, 1, 1), *batching, *model_flags(s.model), *_common(s, s.steps + 1)]
    specs = []
    for r in range(s.overhead_pairs):
        pair = [RunSpec(f"overhead_engine_r{r}", 1, engine_args, meta={"section": "overhead", "who": "engine", "round": r}),
                RunSpec(f"overhead_plain_r{r}", 1, plain_args, kind="plain",
                        meta={"section": "overhead", "who": "plain", "round": r})]
        specs += pair if r % 2 == 0 else pair[::-1]
    return specs


def memory_spec(s: StudySettings, *, precision: str, micro_batch_size: int) -> RunSpec:
    """One trial of the batch search: pp=2 on 2 ranks, 1F1B, 2 micro-batches, 2 steps (the second is measured)."""
    args = [*_mesh(1, 2, 1), "--schedule", "1f1b", "--micro-batch-size", str(micro_batch_size),
            "--microbatches", "2", *model_flags(s.memory_model), *_common(s, 2, precision), "--peak-tflops", "1",
            "--profile-memory"]
    meta = {"section": "memory", "precision": precision, "micro_batch_size": micro_batch_size}
    return RunSpec(f"memory_{precision}_mbs{micro_batch_size}", 2, args, meta=meta)


def split_specs(world: int, s: StudySettings) -> list[RunSpec]:
    """--split auto against uniform on a heavy-head model, pp=2 and pp=4, 1F1B (looped placement) and ZB-V
    (V placement: auto balances each rank's pair of stages), alternated ``rounds`` times, ranks bound to
    cores by their stage costs (--bind-cores cost)."""
    specs = []
    m = s.split_microbatches or s.microbatches
    mbs = s.split_micro_batch_size or s.micro_batch_size
    for schedule in s.split_schedules:
        v = 2 if schedule == "zbv" else 1
        for pp in s.split_pps:
            if pp > world or s.split_model.n_layers < pp * v:
                continue
            for r in range(s.rounds):
                for split in (("auto", "uniform") if r % 2 == 0 else ("uniform", "auto")):
                    # Both splits pin their ranks by their own stage costs: with more ranks than cores the OS
                    # otherwise time-shares the head stage's core with light stages (runtime/cpu_binding.py).
                    args = [*_mesh(1, pp, 1), "--schedule", schedule, "--stages-per-rank", str(v), "--split", split,
                            "--bind-cores", "cost", "--micro-batch-size", str(mbs), "--microbatches", str(m),
                            *model_flags(s.split_model), *_common(s)]
                    meta = {"section": "split", "pp": pp, "schedule": schedule, "split": split, "round": r, "m": m,
                            "micro_batch_size": mbs}
                    specs.append(RunSpec(f"split_{schedule}_pp{pp}_{split}_r{r}", pp, args, meta=meta))
    return specs
