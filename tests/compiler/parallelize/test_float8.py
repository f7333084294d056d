"""compiler/parallelize/float8.py on a stage, as rank 0 of a pretended world (tests/fake_world.py): which linears
become FP8, which token shards each gets (the cp ranks for attention and dense MLPs, a mixture layer's sequence
ranks inside it), and the routed experts' FP8 forward; nothing without --fp8."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from compiler.fp8 import RECIPES, Float8Linear
from compiler.parallelize.float8 import Fp8Options, fp8_shard_problem, maybe_apply_fp8
from models import MoE, build_model, named_config
from tests.fake_world import fake_world


def test_linears_become_fp8_with_the_token_shards_of_their_layer():
    model = build_model(named_config("deepseek-v3-debug"), seed=0)  # latent attention, a dense block, shared experts
    options = Fp8Options(RECIPES["tensorwise"])
    with fake_world(rank=0, world_size=4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "mp"))
        maybe_apply_fp8(model, options, context_parallel=mesh["cp"], sequence=mesh["mp"])
        groups = {"cp": mesh["cp"].get_group(), "moe": mesh["mp"].get_group()}
    kinds = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    kept = {name for name, m in kinds.items() if not isinstance(m, Float8Linear)}
    assert kept == {"head", "layers.1.moe.router.gate", "layers.2.moe.router.gate"}
    for name, module in kinds.items():
        if name in kept:
            continue
        assert module.guard is options.guard and module.recipe is options.recipe
        (x_shard,), (dy_shard,) = module.shards.input, module.shards.grad_output
        assert (x_shard.dim, dy_shard.dim) == (0, 0) and module.shards.weight == ()  # tokens: x and dy's rows
        # the reduction's group: a mixture layer's own tokens (sequence ranks) or the context-parallel ranks
        group = x_shard.amax_reduce.__closure__[0].cell_contents
        assert group is groups["moe" if ".moe." in name else "cp"], name
    experts = [m.experts for m in model.modules() if isinstance(m, MoE)]
    assert experts and all("forward" in vars(e) for e in experts)  # the FP8 grouped product, bound per module


def test_without_fp8_or_split_tokens_nothing_is_added():
    model = build_model(named_config("tiny"), seed=0)
    maybe_apply_fp8(model, None, context_parallel=None, sequence=None)
    assert not any(isinstance(m, Float8Linear) for m in model.modules())
    maybe_apply_fp8(model, Fp8Options(RECIPES["rowwise"]), context_parallel=None, sequence=None)
    swapped = [m for m in model.modules() if isinstance(m, Float8Linear)]
    assert swapped and all(m.shards.input == m.shards.grad_output == () for m in swapped)


def test_only_fixed_size_blocks_constrain_a_mesh():
    llama = named_config("llama3-debug", d_model=256, n_heads=4, n_kv_heads=4, mlp_width=512, seq_len=512)
    for name in ("tensorwise", "rowwise"):  # scales spanning a shard are reduced: any mesh
        assert fp8_shard_problem(named_config("llama3-debug"), RECIPES[name], mp=2, cp=2, sequence_parallel=True) is None
    assert fp8_shard_problem(llama, RECIPES["blockwise"], mp=2, cp=2, sequence_parallel=True) is None
    assert "layers.0.attn.q (256 x 256) on --mp 4 holds 64 rows" in fp8_shard_problem(
        llama, RECIPES["blockwise"], mp=4, cp=1, sequence_parallel=False)
    assert "chunks of 64 tokens" in fp8_shard_problem(llama, RECIPES["blockwise"], mp=1, cp=4, sequence_parallel=False)
