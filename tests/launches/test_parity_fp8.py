"""FP8 parity: a mesh with ``--fp8 X`` trains like one process with ``--fp8 X`` (tests/reference.py runs the same
micro-batches, one FP8 forward and backward each): losses, gradient norms and every parameter's gradient of the
first step, for each recipe on 2x2x2 interleaved + SP, 2x1x2 --ep 2 (a mixture of experts) and 1x2x2 --cp 2. The
nine cases and two with per-shard scales run in two launches (one of 8 ranks, one of 4), as test_parity.py
batches its cases. fp32 (this CPU's bf16 is slow): the FP8 products' high precision follows --precision.
``--fp8-all-gather`` (FSDP gathers the linears' weights as tensorwise FP8) has two cases of its own, 2x2x2 + SP and
2x2x1 under ZeRO-3, in a fixture apart (``-k all-gather``).

Tolerances, from the formats and the tensor sizes.

An FP8 value is its high-precision input rounded onto a grid of relative spacing 2^-m (m = 3 mantissa bits for
e4m3, 2 for e5m2) scaled by its block's scale. A mesh that scales each tensor as the whole tensor is scaled puts
every element on the one process's grid; its inputs differ from the one process's only by fp32 reassociation
(tensor parallelism's partial sums, the vocabulary-parallel loss: |delta| <= K 2^-24 relative for a K-term sum,
~sqrt(K) 2^-24 typically). An element crosses a rounding boundary, moving by a whole grid step (one e4m3 step is
6-12% of it), with probability |delta| / 2^-m, so a step's N quantized elements flip about N sqrt(K) 2^(m-24)
times: for these models (N ~ 1e6 elements a step, K <= 512) a few to tens. A flip does not stay put: its token
moves by ~2^-m / sqrt(K) downstream, and where that token holds the amax of a later tensor (tensorwise: one scale
per tensor, e5m2 gradients) the whole tensor is re-scaled and re-rounded. So flips re-round part of the tensors
that follow them in the backward; a gradient t then moves by up to the recipe's own rounding noise on that part:
with nu_t = |g_fp8 - g_fp32| / |g| (the format's noise through this model's sizes, measured here from the two
one-process references), re-rounding a fraction f of what t sees independently moves it by sqrt(2 f) nu_t.
Per-shard scales put every element of every sharded tensor on another grid: f = 1 everywhere, sqrt(2) nu_t.

The checks: every tensor within nu_t (f <= 1/2) and the median tensor within nu_t / 2 (f <= 1/8: the cascades
reach the tensors behind a flip, not all of them); the first step's loss and gradient norm, means over the B T
tokens of a global batch, within 2^-m sqrt(f / (B T)) relative with f = 1/4 (a quarter of the tokens' terms
re-rounded by a step each), m the recipe's coarsest format; the second step's within 2^-m sqrt(f): AdamW's first
update is lr sign(g) per element, so a re-rounded gradient moves its weight by a whole step, which every token
then sees (no averaging over tokens). Measured (2 steps): correct meshes' worst / median tensors 0.56 / 0.21
nu_t at most (tensorwise, whose one scale per tensor couples every token), rowwise and blockwise below 0.13 /
0.09, EP ~0; per-shard tensorwise 1.11 / 0.89 and more. Rowwise's power-of-two scales make a per-shard scale
differ from the whole's by a power of two, which leaves every value in the normal range on its grid: per-shard
rowwise fails only through subnormals, and blockwise shards hold whole blocks (nothing to reduce), so the
per-shard runs that must fail are tensorwise's (over mp, and over cp).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path

import pytest
import torch

import compiler.fp8.tensor_parallel as fp8_tensor_parallel
import compiler.parallelize.float8 as engine_float8
import tests.launch as launch
from compiler.fp8 import RECIPES
from models import spec_of
from runtime.commands.flags import parse_train_config
from tests.launch import spawn_ranks
from tests.launches.test_parity import case_world, gathered_gradients, train_each_dumping_gradients
from tests.reference import train_reference

pytestmark = pytest.mark.slow  # real multi-process jobs

STEPS = 2
COMMON = ["--precision", "fp32", "--steps", str(STEPS), "--micro-batch-size", "2", "--warmup-steps", "1", "--lr", "3e-3",
          "--log-every", "1", "--eval-every", "0", "--peak-tflops", "1"]
# Shapes whose tensor-parallel shards hold whole 128-wide blocks at mp 2 (blockwise refuses others): q, k, v
# 256 -> 128 rows per rank, o and down 256 / 512 -> 128 / 256 columns.
LLAMA = ["--model", "llama3-debug", "--layers", "4", "--d-model", "256", "--heads", "4", "--kv-heads", "4",
         "--mlp-width", "512", "--seq-len", "64"]
MOE = ["--model", "qwen3-moe-debug", "--d-model", "256", "--heads", "16", "--kv-heads", "16", "--seq-len", "64"]
# Context parallelism's 2 cp chunks per sequence must hold whole 128-token tiles for blockwise: T 512 there.
CP = {name: ["--cp", "2", *(["--seq-len", "512"] if name == "blockwise" else [])] for name in RECIPES}

CASES = [case for name in RECIPES for case in (
    (2, 2, 2, "interleaved-1f1b", [*LLAMA, "--sequence-parallel", "--fp8", name]),
    # selective AC: the recomputation must make the forward's op calls (the amax guard's, a first kernel probe's)
    (2, 1, 2, "1f1b", [*MOE, "--ep", "2", "--fp8", name, "--activation-checkpointing", "selective"]),
    (1, 2, 2, "interleaved-1f1b", [*LLAMA, *CP[name], "--fp8", name]),
)]
PER_SHARD = "per-shard"  # a logdir naming this trains with every amax reduction left out (each shard its own scale)
PER_SHARD_CASES = [(2, 2, 2, "interleaved-1f1b", [*LLAMA, "--sequence-parallel", "--fp8", "tensorwise"]),
                   (1, 2, 2, "interleaved-1f1b", [*LLAMA, *CP["tensorwise"], "--fp8", "tensorwise"])]
# --fp8-all-gather: FSDP gathers the linears' weights as e4m3 bytes quantized with the whole weight's scale, the
# bytes one process quantizes, so the same tolerances hold (with TP + SP + pipelining, and under ZeRO-3's re-gathers).
ALL_GATHER = ["--fp8", "tensorwise", "--fp8-all-gather"]
ALL_GATHER_CASES = [(2, 2, 2, "interleaved-1f1b", [*LLAMA, "--sequence-parallel", *ALL_GATHER]),
                    (2, 2, 1, "interleaved-1f1b", [*LLAMA, "--reshard-after-forward", *ALL_GATHER])]
MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


def _args(case, logdir: Path) -> list[str]:
    dp, pp, mp, schedule, extra = case
    return [f"--dp={dp}", f"--pp={pp}", f"--mp={mp}", "--schedule", schedule, "--microbatches", str(2 * pp),
            "--logdir", str(logdir), *COMMON, *extra]


def _case_id(case) -> str:
    dp, pp, mp, schedule, extra = case
    kind = "ep" if "--ep" in extra else "cp" if "--cp" in extra else "sp"
    modes = "".join(f"-{flag[2:]}" for flag in ("--reshard-after-forward", "--fp8-all-gather") if flag in extra)
    return f"{dp}x{pp}x{mp}-{kind}-{extra[extra.index('--fp8') + 1]}{modes}"


def train_per_shard_where_named(argvs: list[list[str]], out_dirs: list[str]) -> None:
    """``train_each_dumping_gradients``, except that a run whose logdir names ``PER_SHARD`` reduces no amax over
    ranks: each shard's scales are its own (what the engine must not do)."""
    reduce_over = fp8_tensor_parallel.max_over
    run = launch.train

    def max_over(group):
        return (lambda amax: amax) if per_shard[0] else reduce_over(group)

    def train(cfg, *args, **kwargs):
        per_shard[0] = PER_SHARD in cfg.metrics.logdir
        return run(cfg, *args, **kwargs)

    per_shard = [False]
    fp8_tensor_parallel.max_over = engine_float8.max_over = max_over
    launch.train = train
    train_each_dumping_gradients(argvs, out_dirs)


def _train_by_world(root: Path, runs: list[tuple[str, tuple]]) -> dict[str, tuple[Path, str | None]]:
    by_world: dict[int, list[tuple[str, tuple]]] = {}
    for name, case in runs:
        by_world.setdefault(case_world(case), []).append((name, case))
    out = {}
    for world, named in by_world.items():
        argvs = [_args(case, root / name) for name, case in named]
        try:
            spawn_ranks(train_per_shard_where_named, world_size=world, args=(argvs, [str(root / n) for n, _ in named]),
                        timeout=120 + 150 * len(named))
            error = None
        except AssertionError as e:
            error = f"the {world}-rank job of cases {[n for n, _ in named]} failed:\n{str(e)[-4000:]}"
        out.update({name: (root / name, error) for name, _ in named})
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, tuple[Path, str | None]]:
    """Case id -> (its logdir, the error of its job or None): one spawned job per world size."""
    runs = [(_case_id(c), c) for c in CASES] + [(f"{PER_SHARD}-{_case_id(c)}", c) for c in PER_SHARD_CASES]
    return _train_by_world(tmp_path_factory.mktemp("parity_fp8"), runs)


@pytest.fixture(scope="module")
def trained_all_gather(tmp_path_factory) -> dict[str, tuple[Path, str | None]]:
    """The --fp8-all-gather cases, apart (``-k all-gather`` trains only them)."""
    return _train_by_world(tmp_path_factory.mktemp("parity_fp8_all_gather"), [(_case_id(c), c) for c in ALL_GATHER_CASES])


def fp8_parity_failures(case, logdir: Path) -> list[str]:
    """What breaks the module docstring's tolerances in the run ``case`` trained into ``logdir`` (empty: parity)."""
    world = case_world(case)
    cfg = parse_train_config(_args(case, logdir), world_size=world)
    recipe = RECIPES[cfg.plan.fp8]
    fp8 = train_reference(cfg, steps=STEPS)
    fp32 = train_reference(dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, fp8=None)), steps=1)
    summary = json.loads((logdir / "summary.json").read_text())
    got = gathered_gradients(logdir, world_size=world,
                             tied=spec_of(cfg.model).tied_weights if cfg.model.tie_embeddings else {})
    failures = []
    step = 2.0 ** -min(MANTISSA_BITS[dtype] for dtype in recipe.dtypes.values())
    rtols = (step * math.sqrt(1 / 4 / (cfg.global_batch_size * cfg.model.seq_len)), step * math.sqrt(1 / 4))
    for what, mesh, one in (("loss", summary["losses"], fp8.losses), ("grad norm", summary["grad_norms"], fp8.grad_norms)):
        for n, (m, o, rtol) in enumerate(zip(mesh, one, rtols)):
            if abs(m - o) > rtol * abs(o):
                failures.append(f"{what} {n}: {m} vs one process {o} (tolerance {rtol:.1e} relative)")
    ratios = {}
    for name, reference in fp8.first_step_grads.items():
        noise = float((reference - fp32.first_step_grads[name]).norm())
        ratios[name] = float((got[name] - reference).norm()) / noise if noise else float(got[name].ne(reference).any())
    worst = max(ratios, key=ratios.get)
    if ratios[worst] > 1:
        failures.append(f"gradient of {worst}: {ratios[worst]:.2f} x its FP8 noise (tolerance 1)")
    median = statistics.median(ratios.values())
    if median > 1 / 2:
        failures.append(f"median gradient: {median:.3f} x its FP8 noise (tolerance 0.5)")
    print(f"{logdir.name}: worst {worst} {ratios[worst]:.3f}, median {median:.4f} x FP8 noise; losses "
          f"{summary['losses']} vs {fp8.losses} (fp32 {fp32.losses})")
    return failures


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_fp8_losses_and_gradients_match_single_process_fp8(trained, case):
    logdir, error = trained[_case_id(case)]
    assert error is None, error
    assert fp8_parity_failures(case, logdir) == []


@pytest.mark.parametrize("case", PER_SHARD_CASES, ids=[_case_id(c) for c in PER_SHARD_CASES])
def test_scales_computed_per_shard_fail_the_tolerances(trained, case):
    logdir, error = trained[f"{PER_SHARD}-{_case_id(case)}"]
    assert error is None, error
    assert fp8_parity_failures(case, logdir), "per-shard scales passed the FP8 parity tolerances: they cannot tell"


@pytest.mark.parametrize("case", ALL_GATHER_CASES, ids=[_case_id(c) for c in ALL_GATHER_CASES])
def test_fp8_all_gather_matches_single_process_fp8(trained_all_gather, case):
    logdir, error = trained_all_gather[_case_id(case)]
    assert error is None, error
    assert fp8_parity_failures(case, logdir) == []
