"""The bytes autograd keeps per block, head and embedding, for one micro-batch on one rank, in closed form.

Two layouts (``EngineTraits.activations``, compiler/planner/engines.py):

- ``"engine"``, this engine's model as it runs (checked against compiler/cost.py's counts on the engine's
  GPT and Llama, tests/compiler/planner/test_shape.py). Per token of one block and TP shard (t = mp; a = bytes of the
  autocast dtype, 4 in fp32):
  - each norm saves its input in the residual stream's dtype (fp32, or the compute dtype when FSDP gathers
    parameters in it), LayerNorm its mean and 1/std, RMSNorm (fp32 math) also its normalised input and two
    per-token scalars: 4 d + 8 or 8 d + 8 bytes in fp32;
  - the norm's output, cast to the compute dtype by autocast once per projection that reads it (once in
    fp32): GPT's fused q/k/v reads the first (1), Llama's separate q, k and v (3); the MLP's up (and
    SwiGLU's gate: 2) the second;
  - GPT: the fused q/k/v output (H + 2 KV) hd / t, attention's output and log-sum-exp (H / t fp32);
  - Llama: the rotated q, and k and v with their own head counts (attention shares the grouped heads, no
    copies), its output and log-sum-exp; RoPE's cos and sin ([T, hd] each,
    compute dtype) once per micro-batch;
  - GELU MLP: the up projection's output and GELU's output, 2 f / t; SwiGLU: the gate's output, SiLU's
    output, the up projection's output and the product, 4 f / t;
  - with sequence parallelism the norms run on (B, T/mp, D) shards: what they save is 1/mp of it; the
    gathered inputs of the column-parallel matrices stay whole (DTensor saves them).
- ``"megatron"``, Megatron-LM's (and engines alike: Meta's, torchtitan's): everything in the compute dtype,
  Korthikanti et al. 2022 (sec. 4) with SwiGLU and GQA: per token two norm inputs and two linear inputs of
  d (1/t each under sequence parallelism: Megatron saves the shard and gathers it again in backward),
  q, k, v ((H + 2 KV) hd / t), attention's output (H hd / t) and log-sum-exp, the MLP's fused up/gate output
  and the down projection's input (GELU 2 f / t, SwiGLU 3 f / t).

Checkpointing (``ac``): ``"full"`` keeps each block's input (1/t under sequence parallelism) and one
block's full activations while it is recomputed; ``"selective"`` keeps the outputs of the matrix products
and of attention (q, k, v, attention's output and log-sum-exp, the MLP's up / gate outputs) and the two
residual inputs, and recomputes the norms, activation functions and products (torchtitan's op-level SAC,
Megatron's ``--recompute-modules layernorm ...``); while one block's backward runs, the rest of its
activations are recomputed and held with the kept ones.

A mixture-of-experts MLP saves per local token (both layouts): the router's fp32 logits (count x 4), the
``top_k`` dispatched copies of the token (d each), each expert's hidden activations (as a dense MLP of the
expert width) and its output (d, for the weighted combine's backward); shared experts as dense MLPs. With
expert tensor parallelism 1 a TP group's ranks dispatch disjoint sequence shards, so a rank's MoE MLP sees
T / mp tokens (in this engine under SP only: without it every TP rank routes all T, ``moe_shards_need_sp``). The
dispatch's send and receive buffers (2 top_k d a per token) are transient. Megatron's
``--recompute-modules moe`` (selective policy ``"products+moe"``) keeps only the MLP's input (d per token).

Context parallelism (cp ranks) keeps T / cp tokens of every sequence per rank: every per-token term / cp;
attention gathers the sequence's K and V (2 KV hd / t per token of the whole sequence; latent attention gathering
its latent expands them whole and keeps the latent too, r + rope more) and keeps them to its backward in every
layer, which builds their gradients whole (transient) before reduce-scattering them;
selective checkpointing gathers them again in the backward instead (recomputed with the block), and its
backward holds their gradient (in the engine also a whole-size slice gradient); the CPU's split attention
keeps both partial outputs of each chunk (one more attention output and log-sum-exp per token).

The head saves the final norm's input and output and its V / t logits (the stage's output, kept to its
backward, in the compute dtype). With the whole-vocabulary loss (F.cross_entropy on fp32 logits, as Megatron
2021 ran) it also saves their fp32 log-softmax and its backward holds two fp32 gradients of the logits' size.
The chunked loss (``chunked_loss``, the engine's: compiler/parallelize/cross_entropy.py) keeps a log-sum-exp
and a target logit per token and holds the logits' gradient in their dtype plus fp32 working chunks
(compiler/cost.py ``head_loss_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from compiler.context_gather import LATENT, context_gather
from compiler.cost import LayerCost, head_loss_bytes
from compiler.parallelize.cross_entropy import CPU_CHUNK_BYTES, SAVED_BYTES_PER_TOKEN
from compiler.parallelize.halo import halo_width
from compiler.planner.attention_memory import (
    banded_scores_bytes,
    engine_attention,
    engine_latent_attention,
    megatron_attention,
)
from compiler.planner.shape import (
    DENSE,
    MOE,
    DecoderShape,
    _block_matrices,
    attention_matrices,
    block_forward_flops,
    block_params,
    embedding_params,
    head_params,
    mlp_kind,
    mlp_matrices,
    mtp_params,
    shared_width,
    window_of,
)
from compiler.precisions import PRECISIONS


@dataclass(frozen=True)
class Context:
    """How one rank runs its layers for one micro-batch: what the saved bytes depend on."""
    micro_batch_size: int
    precision: str = "fp32"
    mp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    ac: str = "none"  # "none" | "selective" | "full"
    layout: str = "engine"  # "engine" | "megatron"
    residual_bytes: int = 4  # the residual stream's element size (engine: 4, or a under FSDP's param dtype)
    chunked_loss: bool = False
    # the CPU's context-parallel attention runs each chunk as a prefix call and a diagonal call merged by
    # log-sum-exp (compiler/parallelize/context_parallel.py ``_PrefixAndDiagonal``); CUDA runs one call
    split_cp_attention: bool = False
    selective_policy: str = "products"  # what selective recompute keeps (engines.py ``selective_policy``)
    loss_chunk_bytes: int = CPU_CHUNK_BYTES  # the chunked loss's fp32 chunk on this device (``loss_chunk_bytes``)
    cp_halos: bool = False  # sliding layers under CP hold halos, not the gathered sequence (engines.py ``cp_halos``)
    moe_shards_need_sp: bool = False  # a MoE layer under TP routes sequence shards only under SP (engines.py)
    fp8: bool = False  # an FP8 run: CP gathers keys and values, never a latent (compiler/context_gather.py)
    cp_gather: str = "auto"  # what CP gathers for latent attention (the plan's --cp-gather)

    @property
    def a(self) -> int:
        return PRECISIONS[self.precision].dtype.itemsize

    @property
    def autocast(self) -> bool:
        return PRECISIONS[self.precision].autocast_dtype is not None

    def tokens(self, shape: DecoderShape) -> float:
        """Tokens of one micro-batch on this rank: context parallelism splits every sequence."""
        return self.micro_batch_size * shape.seq_len / self.cp


@dataclass(frozen=True)
class BlockMemory:
    """One block's bytes for one micro-batch on one rank."""
    saved: float  # kept from its forward to its backward
    recompute: float  # held while it is recomputed (full AC: its whole activations; else 0)
    transient: float  # held at once inside its forward or backward beyond that (K/V gathered, dispatch buffers)
    backward: float = 0.0  # gradients its backward holds at once beyond what it saved or recomputed (engine, dense)
    # held at once in its forward beyond the saved bytes of the blocks so far (engine: the banded kernel's scores,
    # and the K/V selective checkpointing gathers again); no block is recomputed then and the head has saved nothing
    forward: float = 0.0


def _norm_saved(shape: DecoderShape, residual_bytes: int = 4) -> float:
    """Bytes one norm saves per token in the engine: its input (residual dtype) and, RMSNorm, its fp32
    normalised input; fp32 statistics: LayerNorm's mean and 1/std, RMSNorm's 1/rms (F.rms_norm)."""
    d = shape.d_model
    if shape.norm == "rmsnorm":
        return residual_bytes * d + 4 * d + 4
    return residual_bytes * d + 8


def _mlp_hidden(shape: DecoderShape, width: float, c: Context) -> float:
    """Per token: one MLP's saved hidden activations of ``width`` (already per shard)."""
    if c.ac == "selective":  # the matrix products' outputs only: up (and gate)
        return (2 if shape.mlp == "swiglu" else 1) * width * c.a
    if c.layout == "megatron":
        return (3 if shape.mlp == "swiglu" else 2) * width * c.a
    return (4 if shape.mlp == "swiglu" else 2) * width * c.a


def _moe_mlp(shape: DecoderShape, c: Context) -> float:
    """Per local token of a MoE MLP (its router, dispatched copies, experts, shared experts). In the engine
    (models/common/moe.py, router.py) also: the weighted copy of each expert output the combine sums (d), each routed
    copy's weight (a) and the routing's integer bookkeeping (top-k, sort and unsort indices, 8 bytes each, and the
    fp32 top-k weights: 28 per routed copy, 8 per token)."""
    e, a, d = shape.experts, c.a, shape.d_model
    per_copy = 2 * d * a + _mlp_hidden(shape, e.width, c)
    if c.layout == "engine":
        per_copy += d * a + a + 28
    routed = e.count * 4 + e.top_k * per_copy + (8 if c.layout == "engine" else 0)
    shared = e.shared * _mlp_hidden(shape, shared_width(e), c)
    if e.shared and c.layout == "engine":  # the shared MLP's input: its projections' copies, or in fp32 the norm's output
        shared += (2 if shape.mlp == "swiglu" else 1) * d * a if c.autocast else d * 4
    return routed + shared


def moe_router_bytes(shape: DecoderShape, c: Context) -> float:
    """Per micro-batch in the engine: the router's fp32 copy of its weight (d x E) and two E-long count vectors."""
    return shape.experts.count * (shape.d_model + 2) * 4 if c.layout == "engine" else 0.0


def _readers(shape: DecoderShape, c: Context, kind: str) -> float:
    """Per token: the engine's compute-dtype copies of the two norms' outputs, one per projection reading them."""
    if not c.autocast:
        return 2 * shape.d_model * 4
    attention = 2 if shape.latent is not None else 1 if shape.fused_qkv else 3  # latent: q_a (or q) and kv_a
    if mlp_kind(kind) == DENSE:
        return (attention + (2 if shape.mlp == "swiglu" else 1)) * shape.d_model * c.a
    return attention * shape.d_model * c.a + shape.d_model * 4  # a MoE block's router reads an fp32 copy


def _kv_positions_held(shape: DecoderShape, kind: str, c: Context) -> float:
    """Key positions a rank's attention of ``kind`` holds under CP: the whole sequence gathered, or where halos serve
    the layer, its two chunks each after its W - 1 halo keys."""
    width = halo_width(window_of(kind), shape.seq_len // (2 * c.cp)) if c.cp_halos else None
    return shape.seq_len if width is None else shape.seq_len / c.cp + 2 * width


def block_memory(shape: DecoderShape, kind: str, c: Context) -> BlockMemory:
    """One block's saved, recompute and transient bytes for one micro-batch on one rank (module docstring)."""
    t, d, a = c.mp, shape.d_model, c.a
    tokens = c.tokens(shape)
    shard = t if c.sequence_parallel else 1
    # expert TP 1: the TP ranks route disjoint sequence shards (this engine: under SP; without, each rank all tokens)
    shards = t if mlp_kind(kind) == MOE and (c.sequence_parallel or not c.moe_shards_need_sp) else 1
    moe_tokens = tokens / shards
    if c.layout == "megatron":
        norms = 4 * d * a / shard  # two norm inputs and two linear inputs
        attention = megatron_attention(shape, a=c.a, mp=c.mp)
        selective_norms = 2 * d * a / shard
    else:
        norms = 2 * _norm_saved(shape, c.residual_bytes) / shard + _readers(shape, c, kind)
        attention = (engine_attention(shape, a=c.a, mp=c.mp) if shape.latent is None
                     else engine_latent_attention(shape, a=c.a, mp=c.mp, autocast=c.autocast))
        selective_norms = 2 * shape.d_model * c.residual_bytes / shard
    if c.ac == "selective":
        norms = selective_norms
    dense_mlp = _mlp_hidden(shape, shape.mlp_width / t, c) if mlp_kind(kind) == DENSE else 0.0
    per_token = norms + attention + dense_mlp
    moe_mlp = 0.0
    if mlp_kind(kind) == MOE:  # with --recompute-modules moe its input only: the whole MLP runs again in the backward
        moe_mlp = d * a if c.ac == "selective" and c.selective_policy == "products+moe" else _moe_mlp(shape, c)
    saved = per_token * tokens + moe_mlp * moe_tokens
    if mlp_kind(kind) == MOE and not (c.ac == "selective" and c.selective_policy == "products+moe"):
        saved += moe_router_bytes(shape, c)
    rope_dim = shape.head_dim if shape.latent is None else shape.latent.rope_dim  # cos and sin, [T, rope features]
    rope_bytes = 4 if shape.qk_norm else a  # normed q and k come out of an fp32 weight in fp32: RoPE's cos/sin too
    rope = 2 * shape.seq_len / c.cp * rope_dim * rope_bytes if shape.positions == "rope" and c.layout == "engine" else 0
    saved += rope
    # context parallelism: attention's backward keeps the sequence's gathered K and V (its prefix and diagonal keys are views of
    # them), and the backward builds their gradients whole before reduce-scattering them; selective checkpointing keeps
    # attention's outputs but gathers K and V again (the gather is no kept op: the copy is part of what the block recomputes), and
    # the backward holds the gradient beside it; in this engine also the whole-size zero-filled gradient autograd's slice backward
    # makes of each prefix / diagonal view's gradient (compiler/parallelize/context_parallel.py; seen with torch's memory
    # profiler) (a sliding layer with halos holds only its chunks' keys and the W - 1 before each: compiler/parallelize/halo.py;
    # multi-head latent attention gathering its latent, compiler/context_gather.py: the whole K and V its kv_b expands, and the
    # gathered latent kv_b keeps for its weight's gradient)
    gather = context_gather(shape.latent, kv_heads=shape.kv_heads, head_dim=shape.head_dim, mp=t, fp8=c.fp8, choice=c.cp_gather)
    latent = gather.values_per_token * shape.seq_len if gather.gathers == LATENT else 0
    gathered_kv = ((2 * shape.kv_width / t * _kv_positions_held(shape, kind, c) + latent) * c.micro_batch_size * a
                   if c.cp > 1 else 0.0)
    saved += gathered_kv if c.ac != "selective" else 0.0
    transient = gathered_kv * (2 if c.ac == "selective" and c.layout == "engine" else 1)
    if mlp_kind(kind) == MOE:
        transient += 2 * shape.experts.top_k * d * a * moe_tokens
    forward = 0.0
    if c.layout == "engine":  # the banded kernel's scores (attention_memory.py): in its forward and in its backward
        forward = banded_scores_bytes(shape, kind, micro_batch_size=c.micro_batch_size, mp=t)
        forward += gathered_kv if forward and c.ac == "selective" else 0.0
        transient = max(transient, banded_scores_bytes(shape, kind, micro_batch_size=c.micro_batch_size, mp=t,
                                                       backward=True))
    backward = mlp_backward_bytes(shape, c) if c.layout == "engine" and mlp_kind(kind) == DENSE else 0.0
    if c.ac == "full":
        kept = tokens * d * (c.residual_bytes if c.layout == "engine" else a) / shard
        return BlockMemory(kept, saved, transient, backward, forward)
    if c.ac == "selective":  # its backward recomputes the rest of the block: all of it is held at once
        if c.selective_policy == "every-other-mm" and mlp_kind(kind) == DENSE:
            saved = every_other_mm_kept(shape, c) * tokens
        elif c.layout == "engine" and mlp_kind(kind) == DENSE:  # the engine's kept ops, as compiler/cost.py counts them
            saved = block_selective_bytes(shape, c)
            if c.cp > 1 and c.split_cp_attention:  # every flash call's output is a kept op: both partial
                saved += tokens * (shape.heads // t * (shape.head_dim * a + 4))  # outputs, not the merged one
        elif c.layout == "engine" and c.selective_policy == "products":
            saved = per_token * tokens + moe_selective_kept(shape, c) * moe_tokens + rope
        return BlockMemory(saved, block_memory(shape, kind, replace(c, ac="none")).saved - saved, transient, backward,
                           forward)
    return BlockMemory(saved, 0.0, transient, backward, forward)


def moe_selective_kept(shape: DecoderShape, c: Context) -> float:
    """Per local token, what the engine's selective checkpointing keeps of a MoE MLP: the router's fp32 logits (a
    matrix product) and the shared experts' products; the routed experts run as one grouped product (models/common/
    grouped_mm.py), no kept op (compiler/parallelize/activation_checkpointing.py ``SAVED_OPS``): their tensors, the
    dispatched copies and the combine's are recomputed in the backward (the engine's forward grows by the kept ops
    alone: 3.5 KB a token and block for gpt-oss at d 256, seen with torch's memory profiler)."""
    return shape.experts.count * 4 + shape.experts.shared * _mlp_hidden(shape, shared_width(shape.experts), c)


def every_other_mm_kept(shape: DecoderShape, c: Context) -> float:
    """Per token: what torchtitan's op-level selective checkpointing keeps of a dense block (torchtitan/
    distributed/activation_checkpoint.py ``_custom_policy``, counted afresh in each block): the block's input
    (the checkpoint's), the outputs of the 1st, 3rd, ... matrix product in execution order (q, k, v, o, then
    w1 (gate), w3 (up), w2 (down): q, v, gate and down for Llama), attention's output and log-sum-exp, and
    under sequence parallelism the reduce-scatters' outputs (on its save list too); the rest is recomputed.
    A column-parallel product's output is width / t per token, a row-parallel one's the whole d before its
    reduction; the block input and the reduce-scattered outputs are sequence shards under SP."""
    t, a, d = c.mp, c.a, shape.d_model
    shard = t if c.sequence_parallel else 1
    mlp = mlp_matrices(shape, shape.mlp_width, t)
    order = list(attention_matrices(shape, t).values()) + [mlp[k] for k in ("gate", "up", "down") if k in mlp]
    products = sum(out for _, out in order[::2])  # outputs per token of the 1st, 3rd, ... product
    reduce_scattered = 2 * d / t if c.sequence_parallel and t > 1 else 0.0
    return (d / shard + products + shape.q_width / t + reduce_scattered) * a + shape.heads / t * 4


def mlp_backward_bytes(shape: DecoderShape, c: Context) -> float:
    """The gradients a dense block's backward holds at once beyond its saved and recomputed tensors, at its
    peak: the MLP's product backward (found with torch's memory profiler on this engine's 4-block Llama at
    T 8192, with and without checkpointing). Live there: the block output's gradient (d, residual dtype; a
    sequence shard under SP), the gradient of the down projection's input and, for SwiGLU, of both factors of
    silu(gate) x up (3 f / t; GELU: the down input's and the up output's, 2 f / t; compute dtype); the down
    projection's input itself (f / t) was freed once its weight gradient was taken."""
    shard = c.mp if c.sequence_parallel else 1
    factors = 2 if shape.mlp == "swiglu" else 1
    return (shape.d_model * c.residual_bytes / shard + factors * shape.mlp_width / c.mp * c.a) * c.tokens(shape)


@dataclass(frozen=True)
class HeadMemory:
    saved: float
    transient: float
    kept: float = 0.0  # of ``saved``, what outlives the head's backward: its logits, the stage's output


def head_memory(shape: DecoderShape, c: Context) -> HeadMemory:
    """The final norm, the LM head and the loss on ``V / mp`` vocabulary rows (module docstring)."""
    tokens, rows = c.tokens(shape), -(-shape.vocab_size // c.mp)
    norm = _norm_saved(shape, 4 if c.layout == "engine" else c.a) + shape.d_model * (c.a if c.autocast else 4)
    logits = tokens * rows * PRECISIONS[c.precision].dtype.itemsize  # the stage's output, held to its backward
    if c.chunked_loss:
        _, transient = head_loss_bytes(int(tokens), vocab_rows=rows, precision=c.precision,
                                       chunk_bytes=c.loss_chunk_bytes)
        return HeadMemory(tokens * (norm + SAVED_BYTES_PER_TOKEN) + logits, transient, logits)
    return HeadMemory(tokens * (norm + 4 * rows + 8) + logits, 8 * tokens * rows, logits)


def embedding_memory(shape: DecoderShape, c: Context) -> float:
    """The token ids (8 bytes each) the embedding's backward reads."""
    return 8 * c.tokens(shape)


def block_selective_bytes(shape: DecoderShape, c: Context) -> float:
    """Bytes one dense block keeps for one micro-batch on one TP rank under selective checkpointing as the engine
    runs it (compiler/parallelize/activation_checkpointing.py): its fp32 input, every matrix product's output (a
    bytes per output feature of the shard; a row-parallel product's partial sums are d wide) and attention's
    output and fp32 log-sum-exp."""
    heads = shape.heads // c.mp
    products = sum(out for _, out in _block_matrices(shape, c.mp).values()) * c.a
    return (4 * shape.d_model + products + heads * shape.head_dim * c.a + heads * 4) * c.tokens(shape)


def block_selective_recompute_bytes(shape: DecoderShape, c: Context) -> float:
    """Bytes recomputing one dense block allocates under selective checkpointing: what autograd saves less the
    kept outputs it saves too (they come from the cache): attention's output and log-sum-exp, the MLP's up (and
    SwiGLU's gate) product, and GPT's fused q/k/v product (attention saves views of it) or Llama's v product
    (attention reads it as it is; q and k are rotated copies); the row-parallel products' outputs go into
    residual adds, which save nothing."""
    heads, kv_heads, hd = shape.heads // c.mp, max(1, shape.kv_heads // c.mp), shape.head_dim
    projections = (heads + 2 * kv_heads) * hd if shape.fused_qkv else kv_heads * hd
    mlp = (2 if shape.mlp == "swiglu" else 1) * shape.mlp_width // c.mp
    overlap = (projections + heads * hd + mlp) * c.a + heads * 4
    return block_memory(shape, DENSE, c).saved - overlap * c.tokens(shape)


def analytic_layer_costs(shape: DecoderShape, *, micro_batch_size: int, precision: str = "fp32",
                       mp: int = 1) -> list[LayerCost]:
    """[embedding, block 0, ..., block L-1, head] as compiler/cost.py's ``layer_costs`` reports them for the
    engine's model (FLOPs per TP shard, parameters, saved activations, what selective checkpointing keeps and
    recomputes, autocast weight copies; the engine's chunked loss)."""
    c = Context(micro_batch_size, precision, mp, chunked_loss=True, moe_shards_need_sp=True)
    a, autocast = c.a, c.autocast
    tokens = micro_batch_size * shape.seq_len
    blocks = []
    for i, kind in enumerate(shape.kinds()):
        matmul, attention = block_forward_flops(shape, micro_batch_size=micro_batch_size, mp=mp, kind=kind)
        mats = _block_matrices(shape, mp)
        copies = (sum(x * y for x, y in mats.values()) + (sum(y for _, y in mats.values()) if shape.biases else 0)
                  ) * a if autocast and mlp_kind(kind) == DENSE else 0
        saved = int(block_memory(shape, kind, c).saved)
        selective = (int(block_selective_bytes(shape, c)), int(block_selective_recompute_bytes(shape, c))) \
            if mlp_kind(kind) == DENSE else (saved, 0)
        blocks.append(LayerCost(f"layers.{i}", 3 * matmul + 3.5 * attention, block_params(shape, mp, kind=kind).total,
                                saved, copies, selective_activation_bytes=selective[0],
                                selective_recompute_bytes=selective[1]))
    rows = -(-shape.vocab_size // mp)
    head = head_memory(shape, c)
    embed_saved = int(embedding_memory(shape, c))
    embed = LayerCost("embedding", 0.0, embedding_params(shape, mp), embed_saved, selective_activation_bytes=embed_saved)
    head_cost = LayerCost("head", 6.0 * tokens * shape.d_model * rows, head_params(shape, mp), int(head.saved),
                          rows * shape.d_model * a if autocast else 0, int(head.transient),
                          selective_activation_bytes=int(head.saved))
    return [embed, *blocks, with_mtp(head_cost, shape, c)]


def mtp_saved_bytes(shape: DecoderShape, c: Context) -> float:
    """What the MTP depths keep for backward on the last stage (models/common/mtp.py): per depth its block's, its
    input's (the embedding and h^{k-1}, three norms, the projection's input 2d) and a second head's with its logits."""
    per_depth_input = (2 * shape.d_model * c.a + 3 * shape.d_model * 4 + 2 * shape.d_model * c.a) * c.tokens(shape)
    return sum(block_memory(shape, kind, c).saved + per_depth_input + head_memory(shape, c).saved
               for kind in shape.mtp_kinds())


def with_mtp(head: LayerCost, shape: DecoderShape, c: Context) -> LayerCost:
    """The head's cost with the MTP depths it runs after it (nothing without them)."""
    if not shape.mtp_depth:
        return head
    flops = 0.0
    for kind in shape.mtp_kinds():  # the block, the projection, the head again (FlopCounterMode's 3x and 3.5x)
        matmul, attention = block_forward_flops(shape, micro_batch_size=c.micro_batch_size, mp=c.mp, kind=kind)
        flops += 3 * matmul + 3.5 * attention + 6.0 * c.tokens(shape) * 2 * shape.d_model ** 2 + head.flops
    saved = int(mtp_saved_bytes(shape, c))
    return replace(head, flops=head.flops + flops, params=head.params + mtp_params(shape, c.mp).total,
                   activation_bytes=head.activation_bytes + saved,
                   selective_activation_bytes=head.selective_activation_bytes + saved)
