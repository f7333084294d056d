"""A decoder's shape as the planner prices it, in closed form: no module is built, so a 405B shape costs
what a 124M one does.

``DecoderShape`` is the planner's own description of a decoder-only transformer (GPT-2: GELU MLP,
LayerNorm, biases, learned positions; Llama 3: grouped-query attention, SwiGLU, RMSNorm, no biases,
RoPE). ``analytic_layer_costs`` gives what compiler/cost.py counts for the engine's model (FLOPs with
FlopCounterMode, parameters, the bytes autograd saves), per TP shard, from formulas; the engine's own
split and the CPU planner keep counting (tests/test_shape.py checks the two agree).

FLOPs (the FlopCounterMode convention): a matrix product of [M, K] x [K, N] is 2MNK forward and 4MNK
backward; attention's two products QK^T and AV are 4 T^2 (H hd) per sequence forward without a causal
discount, and torch counts its backward as 5 products (2.5x forward).

Saved activations per token of one block and TP shard (elements x bytes; a = bytes of the autocast
dtype or 4 in fp32; t = mp), from the ops autograd records in the engine's two layouts:
- each norm saves its fp32 input, LayerNorm its mean and 1/std, RMSNorm (models/llama3's: fp32 math)
  also its normalised input and two per-token scalars: 4 d + 8 or 8 d + 8 bytes;
- the norm's output, cast to the compute dtype by autocast once per projection that reads it (once in
  fp32, where no cast happens): GPT's fused q/k/v reads the first (1), Llama's separate q, k and v (3);
  the MLP's up (and SwiGLU's gate: 2) the second;
- GPT: the fused q/k/v output (H + 2 KV) hd / t (q, k, v are views of it), attention's output and
  log-sum-exp (H / t fp32); the output projection reads attention's output in place;
- Llama: attention saves the rotated q, and k and v repeated to the query heads (``repeat_kv`` copies
  them, except with one kv head per rank or none shared, where they stay kv-sized: rotated k and the
  v projection's output), its output and log-sum-exp; RoPE's cos and sin ([T, hd] each, compute dtype)
  once per micro-batch, not per sequence;
- GELU MLP: the up projection's output (GELU's input) and GELU's output, 2 f / t; SwiGLU: the gate's
  output (SiLU's input), SiLU's output and the up projection's output (the product's inputs) and the
  product (the down projection's input), 4 f / t.
The LM head saves the final norm's input and output; the loss (compiler/parallelize/cross_entropy.py) saves
the V / t logits of its shard as they are (a bytes each; the stage keeps them as its output until its
backward anyway) and a few bytes per token, and its backward holds the logits' gradient in their dtype and
two fp32 chunks of rows (compiler/cost.py ``head_loss_bytes``); the embedding saves the token ids (8 bytes
each).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from compiler.cost import LayerCost, head_loss_bytes
from compiler.parallelize.cross_entropy import SAVED_BYTES_PER_TOKEN
from compiler.precisions import PRECISIONS
from models import spec_of


@dataclass(frozen=True)
class DecoderShape:
    layers: int
    d_model: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_width: int
    mlp: str  # "gelu" (up, GELU, down) | "swiglu" (down(silu(gate x) * up x))
    seq_len: int
    vocab_size: int
    tied: bool  # the LM head is the token embedding
    biases: bool  # linear layers and norms carry biases (GPT-2) or not (Llama)
    norm: str  # "layernorm" | "rmsnorm"
    positions: str = "learned"  # "learned" (a [T, d] table, GPT-2) | "rope" (no parameters)
    fused_qkv: bool = True  # one q/k/v projection (GPT-2) or three (Llama)

    @staticmethod
    def from_config(cfg) -> "DecoderShape":
        """From any registered family's config: its sizes, and its family's ``Architecture`` (models/spec.py)
        for what the block is made of."""
        arch = spec_of(cfg).architecture
        return DecoderShape(
            layers=cfg.n_layers, d_model=cfg.d_model, heads=cfg.n_heads, kv_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim, mlp_width=cfg.mlp_width, mlp=arch.mlp, seq_len=cfg.seq_len,
            vocab_size=cfg.vocab_size, tied=cfg.tie_embeddings, biases=arch.biases, norm=arch.norm,
            positions=arch.positions, fused_qkv=arch.fused_qkv)

    @staticmethod
    def from_flags(*, layers: int, d_model: int, heads: int, seq_len: int, vocab_size: int, kv_heads: int | None = None,
                   mlp_width: int | None = None, mlp: str = "gelu", tied: bool | None = None) -> "DecoderShape":
        """``run.py plan --layers --d-model --heads [--kv-heads] [--mlp-width] [--mlp] --seq-len --vocab-size``:
        GELU shapes are GPT-2-like (width 4d), SwiGLU shapes Llama-like (width from Llama's rule, 8d/3
        rounded up to a multiple of 256)."""
        if mlp not in ("gelu", "swiglu"):
            raise ValueError(f"--mlp must be gelu or swiglu, got {mlp}")
        llama = mlp == "swiglu"
        width = mlp_width or default_mlp_width(mlp, d_model)
        return DecoderShape(layers=layers, d_model=d_model, heads=heads, kv_heads=kv_heads or heads,
                            head_dim=d_model // heads, mlp_width=width, mlp=mlp, seq_len=seq_len, vocab_size=vocab_size,
                            tied=(not llama) if tied is None else tied, biases=not llama,
                            norm="rmsnorm" if llama else "layernorm", positions="rope" if llama else "learned",
                            fused_qkv=not llama)

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def shard_error(self, mp: int) -> str | None:
        """Why ``mp`` tensor-parallel ranks cannot split this shape (heads, kv heads, MLP), or None."""
        for name, n in (("--heads", self.heads), ("--kv-heads", self.kv_heads), ("--mlp-width", self.mlp_width)):
            if n % mp:
                return f"--mp {mp} must divide {name} {n}"
        return None


def default_mlp_width(mlp: str, d_model: int) -> int:
    """GPT-2's 4 d; for SwiGLU Llama's rule without a multiplier: 2/3 of 4 d, rounded up to 256."""
    return -(-8 * d_model // 3 // 256) * 256 if mlp == "swiglu" else 4 * d_model


def _norm_params(shape: DecoderShape) -> int:
    return 2 * shape.d_model if shape.norm == "layernorm" and shape.biases else shape.d_model


def _block_matrices(shape: DecoderShape, mp: int) -> dict[str, tuple[int, int]]:
    """(input, output) features of each linear layer of a block, on one TP shard (Megatron layout)."""
    d, f, t = shape.d_model, shape.mlp_width, mp
    if shape.fused_qkv:
        mats = {"qkv": (d, (shape.q_width + 2 * shape.kv_width) // t)}
    else:
        mats = {"q": (d, shape.q_width // t), "k": (d, shape.kv_width // t), "v": (d, shape.kv_width // t)}
    mats.update(o=(shape.q_width // t, d), down=(f // t, d))
    if shape.mlp == "swiglu":
        mats.update(gate=(d, f // t), up=(d, f // t))
    else:
        mats["up"] = (d, f // t)
    return mats


def block_params(shape: DecoderShape, mp: int = 1) -> int:
    """Parameters of one block held by one TP rank; row-parallel biases and the norms are replicated."""
    mats = _block_matrices(shape, mp)
    weights = sum(i * o for i, o in mats.values())
    biases = sum(o for _, o in mats.values()) if shape.biases else 0
    return weights + biases + 2 * _norm_params(shape)


def embedding_params(shape: DecoderShape, mp: int = 1) -> int:
    rows = -(-shape.vocab_size // mp)
    return rows * shape.d_model + (shape.seq_len * shape.d_model if shape.positions == "learned" else 0)


def head_params(shape: DecoderShape, mp: int = 1) -> int:
    """The final norm and the LM head's rows on one TP rank (a tied head's weight counted here too)."""
    return _norm_params(shape) + -(-shape.vocab_size // mp) * shape.d_model


def parameter_count(shape: DecoderShape) -> int:
    """Every distinct parameter (a tied head counted once)."""
    head = head_params(shape) - (shape.vocab_size * shape.d_model if shape.tied else 0)
    return embedding_params(shape) + shape.layers * block_params(shape) + head


def matmul_params(shape: DecoderShape) -> int:
    """N of MFU's 6N: blocks, final norm and head, not the embedding lookups (compiler/flops.py's count)."""
    return shape.layers * block_params(shape) + head_params(shape)


def model_flops_per_token(shape: DecoderShape) -> float:
    """PaLM's count (Chowdhery et al. 2022, appendix B): 6N + 12 L T (H hd), no recompute."""
    return 6.0 * matmul_params(shape) + 12.0 * shape.layers * shape.seq_len * shape.q_width


def hardware_flops_per_token(shape: DecoderShape, *, activation_checkpointing: bool) -> float:
    """Megatron's count (Narayanan et al. 2021, sec. 5.1): with full recompute the blocks run forward
    twice, 8N + 16 L T (H hd) for them; the head 6 N_head. For GPT shapes this is their
    96 B s l h^2 (1 + s / 6h + V / 16lh) per B s tokens (up to biases and norms)."""
    passes = 4 if activation_checkpointing else 3
    blocks = shape.layers * block_params(shape)
    return 2 * passes * blocks + 6 * head_params(shape) + 4 * passes * shape.layers * shape.seq_len * shape.q_width


def block_forward_flops(shape: DecoderShape, *, micro_batch_size: int, mp: int = 1) -> tuple[float, float]:
    """(matmul, attention) forward FLOPs of one block for one micro-batch on one TP rank."""
    tokens = micro_batch_size * shape.seq_len
    matmul = 2.0 * tokens * sum(i * o for i, o in _block_matrices(shape, mp).values())
    attention = 4.0 * tokens * shape.seq_len * shape.q_width / mp
    return matmul, attention


def block_activation_bytes(shape: DecoderShape, *, micro_batch_size: int, precision: str, mp: int = 1,
                           sequence_parallel: bool = False) -> int:
    """Bytes autograd saves in one block for one micro-batch on one TP rank (the module docstring).
    With sequence parallelism the norms and their outputs hold T / mp tokens (Korthikanti et al. 2022)."""
    a = PRECISIONS[precision].dtype.itemsize
    autocast = PRECISIONS[precision].autocast_dtype is not None
    d, f, t, hd = shape.d_model, shape.mlp_width, mp, shape.head_dim
    attention_readers = 1 if shape.fused_qkv or not autocast else 3
    mlp_readers = 2 if shape.mlp == "swiglu" and autocast else 1
    per_token = 2 * _norm_saved(shape) + (attention_readers + mlp_readers) * d * a  # two norms and their outputs
    per_token /= t if sequence_parallel else 1
    heads, kv_heads = shape.heads // t, max(1, shape.kv_heads // t)
    if shape.fused_qkv:
        qkv = (heads + 2 * kv_heads) * hd
        rotated = (heads + kv_heads) * hd if shape.positions == "rope" else 0
        per_token += (qkv + rotated + heads * hd) * a
    else:
        copied = shape.heads > shape.kv_heads and kv_heads > 1  # repeat_kv's expand + flatten is a view otherwise
        per_token += (heads + 2 * (heads if copied else kv_heads) + heads) * hd * a
    per_token += heads * 4 + (4 if shape.mlp == "swiglu" else 2) * f // t * a
    rope_tables = 2 * shape.seq_len * hd * a if shape.positions == "rope" else 0  # cos and sin, per micro-batch
    return int(per_token * micro_batch_size * shape.seq_len + rope_tables)


def block_selective_bytes(shape: DecoderShape, *, micro_batch_size: int, precision: str, mp: int = 1) -> int:
    """Bytes one block keeps for one micro-batch on one TP rank under selective checkpointing
    (compiler/parallelize/activation_checkpointing.py): its fp32 input, every matrix product's output (a bytes
    per output feature of the shard; a row-parallel product's partial sums are d wide) and attention's output
    and fp32 log-sum-exp. Under sequence parallelism the input is a T / mp shard (the memory model's
    ``input_shards``)."""
    a = PRECISIONS[precision].dtype.itemsize
    heads = shape.heads // mp
    products = sum(out for _, out in _block_matrices(shape, mp).values()) * a
    per_token = 4 * shape.d_model + products + heads * shape.head_dim * a + heads * 4
    return int(per_token * micro_batch_size * shape.seq_len)


def block_selective_recompute_bytes(shape: DecoderShape, *, micro_batch_size: int, precision: str, mp: int = 1) -> int:
    """Bytes recomputing one block allocates under selective checkpointing: what autograd saves
    (``block_activation_bytes``) less the kept outputs it saves too, which come from the cache: attention's
    output and log-sum-exp, the MLP's up (and SwiGLU's gate) product, and GPT's fused q/k/v product (attention
    saves views of it) or Llama's v product where attention reads it uncopied (``repeat_kv`` copies it when a
    rank holds several kv heads shared by query heads); Llama's q and k are rotated copies, and the row-parallel
    products' outputs go into residual adds, which save nothing."""
    a = PRECISIONS[precision].dtype.itemsize
    heads, kv_heads, hd = shape.heads // mp, max(1, shape.kv_heads // mp), shape.head_dim
    copied = shape.heads > shape.kv_heads and kv_heads > 1
    projections = (heads + 2 * kv_heads) * hd if shape.fused_qkv else (0 if copied else kv_heads * hd)
    mlp = (2 if shape.mlp == "swiglu" else 1) * shape.mlp_width // mp
    overlap = (projections + heads * hd + mlp) * a + heads * 4
    saved = block_activation_bytes(shape, micro_batch_size=micro_batch_size, precision=precision, mp=mp)
    return int(saved - overlap * micro_batch_size * shape.seq_len)


def _norm_saved(shape: DecoderShape) -> int:
    """Bytes one norm saves per token: its fp32 input (and RMSNorm its normalised input), and two fp32
    statistics (LayerNorm: mean and 1/std; RMSNorm: the norm and 1/rms)."""
    if shape.norm == "rmsnorm":
        return 2 * shape.d_model * 4 + 8
    return shape.d_model * 4 + 8


def analytic_layer_costs(shape: DecoderShape, *, micro_batch_size: int, precision: str = "fp32",
                         mp: int = 1) -> list[LayerCost]:
    """[embedding, block 0, ..., block L-1, head] as compiler/cost.py's ``layer_costs`` reports them."""
    b, T, d = micro_batch_size, shape.seq_len, shape.d_model
    a = PRECISIONS[precision].dtype.itemsize
    autocast = PRECISIONS[precision].autocast_dtype is not None
    tokens = b * T
    matmul, attention = block_forward_flops(shape, micro_batch_size=b, mp=mp)
    block_matrix_weights = sum(i * o for i, o in _block_matrices(shape, mp).values())
    block_copies = (block_matrix_weights + (sum(o for _, o in _block_matrices(shape, mp).values())
                                            if shape.biases else 0)) * a if autocast else 0
    block = LayerCost("block", 3 * matmul + 3.5 * attention, block_params(shape, mp),
                      block_activation_bytes(shape, micro_batch_size=b, precision=precision, mp=mp), block_copies,
                      selective_activation_bytes=block_selective_bytes(shape, micro_batch_size=b, precision=precision,
                                                                       mp=mp),
                      selective_recompute_bytes=block_selective_recompute_bytes(shape, micro_batch_size=b,
                                                                                precision=precision, mp=mp))
    rows = -(-shape.vocab_size // mp)
    embed = LayerCost("embedding", 0.0, embedding_params(shape, mp), 8 * tokens, selective_activation_bytes=8 * tokens)
    norm_saved = _norm_saved(shape) + d * (a if autocast else 4)
    held, transient = head_loss_bytes(tokens, vocab_rows=rows, precision=precision)
    head_saved = tokens * (norm_saved + SAVED_BYTES_PER_TOKEN) + held
    head = LayerCost("head", 6.0 * tokens * d * rows, head_params(shape, mp), head_saved,
                     rows * d * a if autocast else 0, transient, selective_activation_bytes=head_saved)
    return [embed, *(replace(block, name=f"layers.{i}") for i in range(shape.layers)), head]
