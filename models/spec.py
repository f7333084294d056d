"""The model-spec protocol: everything the compiler, the engine and the tools know about a model family.

A family (GPT-2, Llama 3, ...) is one folder of ``models/`` that exports one ``ModelSpec`` and registers
it in ``models/__init__.py``; nothing outside ``models/`` imports a family's modules. The spec is a row of
facts and functions, read by everyone:

- its config dataclass and named sizes (``--model`` choices), and how flag overrides apply to a size; every
  config has ``seq_len`` (the training window, what the engine traces) and ``context`` (the positions the
  model takes, e.g. GPT-2's n_positions: a model's, never changed by the window; ``models.with_window``);
- ``build(cfg, share_tied_weights=...)``: the module, on the current default device (the engine builds on
  the meta device and traces it, so ``forward`` must create no tensor on a device of its own: derive
  positions from the input with ``*_like``, never ``torch.arange(device=...)``);
- ``initial_value(name, shape, seed=, cfg=)``: every parameter's initial value as a pure function of
  (seed, name, shape), so a rank initialises just the shards it holds (``name_seeded_normal``);
- its tensor-parallel plan as data: styles per block-relative module name, and the embedding and head
  split over the vocabulary; with ``--sequence-parallel`` the block plan adds the norms' styles;
- its tied weights ({copy: source}, applied when the config ties embeddings);
- ``check(cfg, mp)``: why a shape cannot run on mp tensor-parallel ranks, a ``ShapeProblem`` in the model's own
  terms (config fields; the engine names the flags), e.g. mp not dividing the heads;
- FLOPs per token (MFU's numerator: a mixture's activated parameters) and, through ``build``, the per-layer
  costs the partitioner counts; each block's kind (dense or mixture of experts: ``block_kinds``);
  each block's attention window (``attention_windows``: None for full causal attention, gpt-oss's sliding layers' W);
  its ``Architecture`` (MLP kind, norm, positions, biases, attention sinks) and, for a mixture of experts, its ``Experts``
  (``experts(cfg)``: counts and widths, shared experts, the dense layers), for latent attention its ``LatentSizes``,
  the planner's description of it: data only, so a new family is priced at any scale without planner code;
- its Hugging Face adapter (names, transposes or permutations, ``config.json`` both ways).

The module a family builds follows one naming contract, so that splitting, tying and vocabulary
parallelism are generic: the token embedding is ``tok_emb`` (an ``nn.Embedding``), the blocks live in a
``ModuleDict`` ``layers`` keyed "0".."L-1", the final norm is ``norm`` and the LM head ``head`` (an
``nn.Linear``). ``embed(tokens)`` is everything before block 0, ``hidden(tokens)`` the residual stream after the last block,
``logits(hidden)`` the final norm and head, and ``forward(tokens) == logits(hidden(tokens))``. A model of
``mtp_depth`` D > 0 also holds ``mtp``, its multi-token-prediction depths (models/common/mtp.py), which
``forward`` does not run. Attention reshapes with ``-1`` heads, so a
tensor-parallel shard holding H/mp heads traces the same graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import nn

# Tensor-parallel styles a plan names (compiler/parallelize/tensor_parallel.py applies them).
COLWISE = "colwise"  # output features sharded (Megatron's column-parallel linear)
ROWWISE = "rowwise"  # input features sharded, partial outputs all-reduced (row-parallel linear)
VOCAB_EMBEDDING = "vocab_embedding"  # rows (vocabulary) sharded, token ids replicated, output all-reduced
VOCAB_HEAD = "vocab_head"  # output features (vocabulary) sharded, logits left sharded for the loss
# Sequence parallelism (Korthikanti et al. 2022): the norms run on sequence shards; the attention and MLP
# gather the sequence before their column-parallel matrices and reduce-scatter after their row-parallel ones.
SEQUENCE_NORM = "sequence_norm"  # a norm on a (B, T/mp, D) sequence shard
GATHER_SEQUENCE = "gather_sequence"  # module input: all-gather the sequence shards
ROWWISE_SCATTER = "rowwise_scatter"  # row-parallel linear whose output is reduce-scattered over the sequence
VOCAB_HEAD_FROM_SEQUENCE = "vocab_head_from_sequence"  # VOCAB_HEAD whose input arrives as sequence shards
# A norm applied per head (Qwen3's q/k norms) to a tensor whose heads are sharded over mp: its weight is shared by
# every head, so its gradient is summed over the mp ranks' heads.
HEAD_NORM = "head_norm"
# A parameter-free module whose input, the same on every mp rank, feeds every head (multi-head latent attention's
# RoPE key): forward unchanged; its gradient, each rank's heads' part, summed over mp (Megatron's "f").
HEAD_SHARED = "head_shared"
# A module acting on each head apart with one parameter value per head (gpt-oss's attention sinks, models/common/
# attention.py ``AttentionSinks``): its parameters split on dim 0 with the heads, its inputs (B, H/mp, ...) this rank's
# heads, its output too.
HEADWISE = "headwise"
# A linear layer replicated on every mp rank that takes the sequence-parallel gather (a Replicate DTensor) as input
# (multi-head latent attention's down projections under --sequence-parallel): weight Replicate, output local.
REPLICATED = "replicated"
# A linear layer replicated on every mp rank and applied to (B, T/mp, .) sequence shards, its output a local shard (the
# multi-token-prediction depths' projection under --sequence-parallel): its gradient summed over mp, as an SP norm's.
SEQUENCE_LINEAR = "sequence_linear"

# Block kinds (``ModelSpec.block_kinds``): a block's feed-forward part is a dense MLP (``mlp``) or a mixture of
# experts (``moe``, models/common/moe.py). Costs differ by kind (compiler/cost.py profiles one block of each).
DENSE, MOE = "dense", "moe"

# The naming contract's fixed names (see the module docstring).
TOKEN_EMBEDDING = "tok_emb"
FINAL_NORM = "norm"
LM_HEAD = "head"
VOCAB_TP_PLAN: Mapping[str, str] = {TOKEN_EMBEDDING: VOCAB_EMBEDDING, LM_HEAD: VOCAB_HEAD}
# --sequence-parallel keeps the residual stream on sequence shards up to the head (Megatron-LM): the final norm
# runs on shards and the head all-gathers the sequence. (Where the embedding splits it: compiler/parallelize.)
SEQUENCE_PARALLEL_MODEL_PLAN: Mapping[str, str] = {FINAL_NORM: SEQUENCE_NORM, LM_HEAD: VOCAB_HEAD_FROM_SEQUENCE}
TIED_EMBEDDINGS: Mapping[str, str] = {f"{LM_HEAD}.weight": f"{TOKEN_EMBEDDING}.weight"}


@dataclass(frozen=True)
class Architecture:
    """What a family's block is made of, for pricing shapes in closed form without building them
    (compiler/planner/shape.py)."""

    mlp: str  # "gelu" (two matrices) or "swiglu" (gate, up, down)
    norm: str  # "layernorm" (weight and bias) or "rmsnorm" (weight)
    positions: str  # "learned" (a table of ``context`` rows) or "rope"
    biases: bool  # the linear layers have biases
    fused_qkv: bool  # one q/k/v projection
    qk_norm: bool = False  # a norm over each head's queries and keys before attention (Qwen3)
    sinks: bool = False  # a learned sink logit per head in each softmax's denominator (gpt-oss)


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts MLP as the planner prices it (compiler/planner/shape.py reads it; data only).

    Each block's MLP is a router (d x ``count`` logits), ``count`` routed experts of hidden width ``width``
    of which every token uses ``top_k`` (weighted by the router), and ``shared`` experts of width
    ``shared_width`` every token passes through; an expert is an MLP of the family's kind (SwiGLU: gate, up,
    down). The blocks listed in ``dense_layers`` keep the dense MLP of the config's ``mlp_width`` instead
    (DeepSeek's first-k-dense layers: ``dense_layers=range(k)``). Activated parameters per token count
    ``top_k + shared`` experts, total parameters all of them."""

    count: int
    top_k: int
    width: int
    shared: int = 0
    shared_width: int = 0  # 0: ``width``
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if not 1 <= self.top_k <= self.count:
            raise ValueError(f"experts: top_k {self.top_k} must be between 1 and the {self.count} experts")


def no_experts(cfg: Any) -> Experts | None:
    """A dense family's ``experts``: every block has the dense MLP."""
    return None


@dataclass(frozen=True)
class LatentSizes:
    """Multi-head latent attention's sizes (DeepSeek-V2 sec. 2.1; models/common/latent_attention.py), as the
    planner prices it (data only): queries through a ``q_lora_rank`` latent (0: one projection), keys and values
    from a ``kv_lora_rank`` latent plus one RoPE key of ``rope_dim`` every head shares; per head, q and k have
    ``nope_dim + rope_dim`` features, v ``v_dim``."""

    n_heads: int  # num_attention_heads
    q_lora_rank: int  # q_lora_rank; 0: one q projection (DeepSeek-V2-Lite)
    kv_lora_rank: int
    nope_dim: int  # qk_nope_head_dim
    rope_dim: int  # qk_rope_head_dim
    v_dim: int  # v_head_dim

    @property
    def qk_dim(self) -> int:
        return self.nope_dim + self.rope_dim  # qk_head_dim

    def matrices(self, d_model: int) -> dict[str, tuple[int, int]]:
        """(input, output) features of each attention linear of a block, by module name (whole: tensor parallelism
        splits the heads of ``q``, ``kv_b`` and ``o`` and replicates ``q_a`` and ``kv_a``)."""
        h = self.n_heads
        q = {"q_a": (d_model, self.q_lora_rank), "q": (self.q_lora_rank, h * self.qk_dim)} if self.q_lora_rank \
            else {"q": (d_model, h * self.qk_dim)}
        return {**q, "kv_a": (d_model, self.kv_lora_rank + self.rope_dim),
                "kv_b": (self.kv_lora_rank, h * (self.nope_dim + self.v_dim)), "o": (h * self.v_dim, d_model)}

    def norm_params(self) -> int:
        """The latents' RMSNorm weights (q_a_norm, kv_a_norm)."""
        return self.q_lora_rank + self.kv_lora_rank


def no_latent_attention(cfg: Any) -> LatentSizes | None:
    """A family without multi-head latent attention."""
    return None


@dataclass(frozen=True)
class HFAdapter:
    """A family's Hugging Face layout: ``config.json`` and the tensors of ``*ForCausalLM``, both ways.

    ``to_hf`` maps a whole state dict of ours (full tensors; meta tensors give just the names and shapes)
    to Hugging Face's. ``from_hf(name, cfg)`` says which Hugging Face tensors one of our parameters is made
    of and how: ``(hf_names, combine)`` with ``combine(*tensors) -> our tensor``, so a loader reads only the
    tensors of the parameters it holds.
    """

    architectures: tuple[str, ...]  # config.json "architectures" this family reads; the first is written
    model_types: tuple[str, ...]  # config.json "model_type" values this family reads
    config_to_hf: Callable[[Any], dict]
    config_from_hf: Callable[[dict], Any]  # raises ValueError naming the key on a config it cannot build
    to_hf: Callable[[Mapping[str, torch.Tensor], Any], dict[str, torch.Tensor]]
    from_hf: Callable[[str, Any], tuple[tuple[str, ...], Callable[..., torch.Tensor]]]
    # stacked(name): our parameter is its Hugging Face tensors stacked on dim 0, row e the e-th name from_hf gives
    # (a mixture's experts), so a reader holding rows a..b-1 reads those tensors alone
    stacked: Callable[[str], bool] = lambda name: False
    # row_wise(name): our parameter's row e comes from row e of each Hugging Face tensor alone (combine works row by
    # row on dim 0: gpt-oss's fused experts [E, ...]), so a reader holding rows a..b-1 reads just those rows of each
    row_wise: Callable[[str], bool] = lambda name: False
    # The tensors the family's released checkpoints store quantized, by layout (runtime/checkpoint/quantized/export.py's
    # methods; ``run.py export --export-dtype METHOD``): {method: (Hugging Face name patterns stored so,
    # quantization_config's modules_to_not_convert or None)}
    quantized: Mapping[str, tuple[tuple[str, ...], tuple[str, ...] | None]] = field(default_factory=dict)


MP = "mp"  # a ``ShapeProblem``'s name for the tensor-parallel ranks, which no config field holds
# What a field is, for messages: "must divide the head count (n_heads 12)".
FIELD_NOUNS = {"d_model": "the model width", "n_heads": "the head count", "n_kv_heads": "the key/value head count",
               "mlp_width": "the MLP width", "head_dim": "the head dimension", "n_experts": "the expert count",
               "top_k": "the experts per token"}


@dataclass(frozen=True)
class ShapeProblem:
    """Why a model's shape cannot run, in the model's own terms: config fields (``MP`` for the tensor-parallel
    ranks), never command-line flags, which only the engine's edge knows (runtime/config.py). ``field``'s
    ``value`` must ``requirement`` (a verb phrase: "divide", "be positive") the ``other`` field's ``other_value``;
    ``valid``: the values of ``field`` that would do, the other fields as they are (empty: not listed). A field
    no setting holds but a quotient of others (head_dim = d_model / n_heads) names them in ``derived_from``."""

    field: str
    value: int | str
    requirement: str
    other: str | None = None
    other_value: int | None = None
    valid: tuple[int | str, ...] = ()
    reason: str = ""  # why, where the requirement does not say it: "for rotary embeddings"
    derived_from: tuple[str, ...] = ()

    @property
    def fields(self) -> tuple[str, ...]:
        """The fields the message names."""
        return (*(self.derived_from or (self.field,)), *((self.other,) if self.other else ()))

    def message(self, name: Callable[[str], str] = lambda field: field) -> str:
        """One line, each field called ``name(field)``: its own name by default, its flag at the engine's edge."""
        if self.derived_from:
            subject = f"{FIELD_NOUNS[self.field]} ({' / '.join(map(name, self.derived_from))} = {self.value})"
        else:
            subject = f"{name(self.field)} {self.value}"
        text = f"{subject} must {self.requirement}"
        if self.other is not None:
            text += f" {FIELD_NOUNS[self.other]} ({name(self.other)} {self.other_value})"
        text += f" {self.reason}" if self.reason else ""
        if self.valid:
            text += f"; valid {name(self.field)} values: {', '.join(map(str, self.valid))}"
        return text


class ModelShapeError(ValueError):
    """A model built with a shape it cannot have; ``problem`` says why (``ShapeProblem``)."""

    def __init__(self, problem: ShapeProblem):
        super().__init__(problem.message())
        self.problem = problem


@dataclass(frozen=True)
class ModelSpec:
    family: str  # "gpt2", "llama3": the value of every config's ``family`` field
    description: str
    config_type: type
    sizes: Mapping[str, Any]  # named sizes: ``--model`` choices -> config
    debug_size: str  # the smallest size, for tests (runs on 8 CPU ranks in seconds)
    build: Callable[..., nn.Module]  # build(cfg, *, share_tied_weights=True)
    initial_value: Callable[..., torch.Tensor]  # initial_value(name, shape, *, seed, cfg) -> fp32 CPU tensor
    with_overrides: Callable[..., Any]  # with_overrides(base_cfg, **fields given by flags) -> cfg
    check: Callable[[Any, int], ShapeProblem | None]  # check(cfg, mp): why this shape cannot run on mp ranks, or None
    flops_per_token: Callable[[Any], float]  # training FLOPs per token (6N + attention), for MFU
    block_tp_plan: Mapping[str, str]  # block-relative module name -> style
    sequence_parallel_plan: Mapping[str, str]  # replaces / adds block entries under --sequence-parallel
    hf: HFAdapter
    architecture: Architecture
    model_tp_plan: Mapping[str, str] = field(default_factory=lambda: dict(VOCAB_TP_PLAN))
    tied_weights: Mapping[str, str] = field(default_factory=lambda: dict(TIED_EMBEDDINGS))
    config_from_dict: Callable[[dict], Any] | None = None  # default: config_type(**d)
    block_kinds: Callable[[Any], tuple[str, ...]] = lambda cfg: (DENSE,) * cfg.n_layers  # each block's kind
    experts: Callable[[Any], Experts | None] = no_experts  # experts(cfg): the MoE MLP of a size, or None
    # latent_attention(cfg): multi-head latent attention's sizes, or None (grouped-query attention)
    latent_attention: Callable[[Any], LatentSizes | None] = no_latent_attention
    # attention_windows(cfg): each block's sliding window (keys a query sees), None for full causal attention
    attention_windows: Callable[[Any], tuple[int | None, ...]] = lambda cfg: (None,) * cfg.n_layers

    def block_plan(self, *, sequence_parallel: bool) -> dict[str, str]:
        return {**self.block_tp_plan, **(self.sequence_parallel_plan if sequence_parallel else {})}

    def model_plan(self, *, sequence_parallel: bool) -> dict[str, str]:
        """Styles of the model-level modules (embedding, final norm, head) by name."""
        return {**self.model_tp_plan, **(SEQUENCE_PARALLEL_MODEL_PLAN if sequence_parallel else {})}


class EagerModule(nn.Module):
    """A module the engine runs eagerly, outside the traced pipeline graph: its forward may loop over data
    (documents, experts), exchange tokens with other ranks once the engine wraps it, or record what it saw
    (tokens per expert). The pipeline tracer sees ``trace_forward`` instead (the same signature, output shapes
    and dtypes, static shapes only; by default ``forward`` itself), and the engine then puts this very module,
    holding the same parameters, back in place of its traced copy (compiler/trace.py): the parent graph calls
    it by name."""

    def trace_forward(self, *args, **kwargs):
        # The class's forward: while tracing, the instance's ``forward`` is this method (compiler/trace.py).
        return type(self).forward(self, *args, **kwargs)


def run_blocks(layers: nn.ModuleDict, x: torch.Tensor, positions: torch.Tensor | None,
               documents: torch.Tensor | None = None) -> torch.Tensor:
    """The blocks in order. With explicit positions (packed documents, a context-parallel slice of a sequence)
    and document ids every block gets its own copies: the tracer places the copies made before block i in the
    stage that precedes a split at block i, so they travel from stage to stage with the activations (a
    pipeline stage other than the first cannot read the model's inputs)."""
    for block in layers.values():
        if positions is None:
            x = block(x)  # the traced graph of plain sequences calls each block with one input
        elif documents is None:
            positions = positions.clone()
            x = block(x, positions)
        else:
            positions, documents = positions.clone(), documents.clone()
            x = block(x, positions, documents)
    return x


def name_seed(seed: int, name: str) -> int:
    """A stable (not Python-hash-randomised) 63-bit mix of the seed and a parameter name."""
    h = seed & 0xFFFFFFFF
    for ch in name.encode():
        h = (h * 1000003 ^ ch) & 0x7FFFFFFFFFFFFFFF
    return h


def name_seeded_normal(name: str, shape: tuple[int, ...], *, seed: int, std: float) -> torch.Tensor:
    """N(0, std^2) values drawn from a generator seeded by (seed, name): the same whether the whole model,
    one pipeline stage or one shard of the parameter is being initialised."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(name_seed(seed, name))).mul_(std)


def divisors(n: int, *others: int) -> tuple[int, ...]:
    """The divisors of ``n`` that divide every one of ``others`` too, ascending."""
    return tuple(d for d in range(1, n + 1) if n % d == 0 and all(o % d == 0 for o in others))


def listed_divisors(n: int, *others: int) -> str:
    """``divisors`` as a message lists them: "1, 2, 4"."""
    return ", ".join(map(str, divisors(n, *others)))
