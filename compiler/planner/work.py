"""One layer's work for one micro-batch on one rank, device-independent (compiler/planner/devices.py prices it).

Per rank: b sequences of T / cp tokens (context parallelism), M = b T / cp rows; t = mp TP ranks.
- A dense block: each linear layer of the Megatron layout (compiler/planner/shape.py) as a product
  [M, in] x [in, out] per shard; attention's QK^T and AV: with FlashAttention the causal half of
  4 b (H / t) (T / cp) T hd FLOPs (load-balanced context parallelism gives every rank 1/cp of the causal
  work: 2 cp chunks, head-tail), materialised: two batched products per sequence and head and the T x T
  scores through HBM; memory-bound kernels move per row about 10 d values of the residual stream (two norms
  read and write it, two residual adds read two and write one; 1/t of it under sequence parallelism) plus
  2 (q + 2 kv) / t and 2 q / t for the attention's reshapes and 2 f / t (GELU) or 3 f / t (SwiGLU).
- Multi-head latent attention under CP gathering its latent (compiler/context_gather.py): ``kv_b`` multiplies all
  b T rows of the gathered latent, not b T / cp, and its keys' and values' reshapes run over them too.
- A MoE block: attention as above; the router [M', d] x [d, E] on the M' = M / t rows a rank dispatches
  (expert tensor parallelism 1: the TP ranks take disjoint sequence shards; this engine only under SP, else
  M' = M); the routed experts as a grouped
  product of E / ep experts with M' top_k ep / E rows each (balanced routing); shared experts as TP-split
  dense MLPs on M rows; memory-bound: the dispatch's permute and un-permute (4 d per token copy), the
  experts' activation (3 w or 2 w) and the router's softmax and top-k over E fp32 logits.
- The head: [M, d] x [d, V / t] and the loss over fp32 logits (written once, read and written by the
  softmax forward and backward); the embedding: a gather of rows.
``counted_flops`` is torch's FlopCounterMode count (3 x matmuls, 3.5 x attention without a causal
discount), the unit of the CPU's calibrated rate.
- ``--fp8``: the attention's and MLPs' linears and the experts run at the device's FP8 rate (layers.py); their
  quantizers are memory-bound passes over each product's high-precision operands (``quantize_bytes``); the
  router and the head stay in the precision.
"""

from __future__ import annotations

from compiler.context_gather import LATENT, context_gather
from compiler.fp8 import RECIPES
from compiler.fp8.tensor import GRAD_DGRAD, GRAD_WGRAD
from compiler.planner.devices import Gemm, LayerWork
from compiler.planner.engines import EngineTraits
from compiler.planner.shape import (
    DENSE,
    DecoderShape,
    attention_matrices,
    mlp_kind,
    mlp_matrices,
    shared_width,
    tensor_parallel_modules,
    window_of,
)
from compiler.precisions import PRECISIONS

EMBEDDING, HEAD = "embedding", "head"


def _linears(mats: dict[str, tuple[int, int]], rows: float) -> list[Gemm]:
    return [Gemm(rows, out, inp) for inp, out in mats.values()]


def _attention(shape: DecoderShape, kind: str, *, b: int, rows: float, t: int, cp: int,
               traits: EngineTraits) -> tuple[list[Gemm], float, float, float]:
    """(batched products, flash FLOPs run, scores through HBM, counted FLOPs forward) of one block's attention; a
    sliding block's queries each meet the ``keys`` of their window (all of them run: no causal half)."""
    T, heads, hd = shape.seq_len, shape.heads / t, shape.head_dim
    keys = shape.keys(kind)
    counted = 4.0 * rows * keys * shape.q_width / t  # FlopCounterMode: no causal discount
    if traits.attention in ("flash", "fused"):
        return [], counted / 2 if window_of(kind) is None else counted, 0.0, counted
    q = T / cp
    products = [Gemm(q, keys, hd, groups=b * heads), Gemm(q, hd, keys, groups=b * heads)]
    return products, 0.0, b * heads * q * keys, counted  # scores: elements (the device weighs their bytes)


def quantize_bytes(gemms: list[Gemm], recipe: str, itemsize: int) -> tuple[float, float]:
    """(forward, backward) bytes of the FP8 quantizers of these products (compiler/fp8/linear.py): each quantization
    reads its high-precision operand once for the amax and once more to write one byte per element, 2a + 1 bytes
    an element. Forward: x [m, k] and W [n, k]; backward: dy [m, n] once where the recipe's two layouts of it agree
    (tensorwise) and twice elsewhere, W again for the input gradient and x again for the weight gradient."""
    blocks = RECIPES[recipe].blocks
    dy_passes = 1 if blocks[GRAD_DGRAD] == blocks[GRAD_WGRAD] else 2
    per, forward, backward = 2 * itemsize + 1, 0.0, 0.0
    for g in gemms:
        x, w, dy = g.m * g.k * g.groups, g.n * g.k * g.groups, g.m * g.n * g.groups
        forward += (x + w) * per
        backward += (x + w + dy_passes * dy) * per
    return forward, backward


def block_work(shape: DecoderShape, kind: str, *, micro_batch_size: int, mp: int, cp: int, ep: int, precision: str,
               sequence_parallel: bool, traits: EngineTraits, fp8: str | None = None, cp_gather: str = "auto") -> LayerWork:
    b, t = micro_batch_size, mp
    a = PRECISIONS[precision].dtype.itemsize
    rows = b * shape.seq_len / cp
    # CP gathering a latent: kv_b expands, and its keys and values are reshaped, over the whole sequence
    whole = cp > 1 and context_gather(shape.latent, kv_heads=shape.kv_heads, head_dim=shape.head_dim, mp=t,
                                      fp8=fp8 is not None, choice=cp_gather).gathers == LATENT
    gemms = [Gemm(rows * cp if whole and name == "kv_b" else rows, out, inp)
             for name, (inp, out) in attention_matrices(shape, t).items()]
    batched, flash, scores, attention_counted = _attention(shape, kind, b=b, rows=rows, t=t, cp=cp, traits=traits)
    replicated = 10 * shape.d_model / (t if sequence_parallel else 1)
    split = 2 * (shape.q_width + 2 * shape.kv_width * (cp if whole else 1)) / t + 2 * shape.q_width / t
    grouped: list[Gemm] = []
    quantized = list(gemms)  # the linears FP8 runs: not the router
    if mlp_kind(kind) == DENSE:
        gemms += _linears(mlp_matrices(shape, shape.mlp_width, t), rows)
        quantized = list(gemms)
        split += (3 if shape.mlp == "swiglu" else 2) * shape.mlp_width / t
        elementwise = rows * (replicated + split) * a
    else:
        moe = moe_mlp_work(shape, micro_batch_size=b, mp=t, cp=cp, ep=ep, precision=precision,
                           routed_shards=moe_routed_shards(traits, mp=t, sequence_parallel=sequence_parallel))
        gemms += list(moe.gemms)
        grouped = list(moe.grouped)
        quantized += [*moe.gemms[1:], *grouped]  # moe.gemms[0]: the router
        elementwise = rows * (replicated + split) * a + moe.elementwise_bytes
    matmul_forward = sum(g.flops for g in gemms + grouped)
    return LayerWork(tuple(gemms + batched), tuple(grouped), attention_flops=flash, attention_head_dim=shape.head_dim,
                     attention_keys=shape.keys(kind), attention_kernel="fused" if traits.attention == "fused" else "flash",
                     scores=scores, elementwise_bytes=elementwise,
                     counted_flops=3 * matmul_forward + 3.5 * attention_counted,
                     counted_forward_flops=matmul_forward + attention_counted,
                     tensor_parallel_modules=tensor_parallel_modules(shape, kind, sequence_parallel=sequence_parallel)
                     if mp > 1 else 0, quantize_bytes=quantize_bytes(quantized, fp8, a) if fp8 else (0.0, 0.0))


def moe_routed_shards(traits: EngineTraits, *, mp: int, sequence_parallel: bool) -> int:
    """Into how many disjoint shards a TP group's MoE layer splits the tokens it routes (``moe_shards_need_sp``)."""
    return 1 if traits.moe_shards_need_sp and not sequence_parallel else mp


def moe_mlp_work(shape: DecoderShape, *, micro_batch_size: int, mp: int, cp: int, ep: int, precision: str,
                 routed_shards: int | None = None) -> LayerWork:
    """A MoE block's MLP alone (module docstring): the router, the shared experts, the routed experts' grouped
    products and their memory-bound kernels. What Megatron's ``--recompute-modules moe`` runs again.
    ``routed_shards``: the TP ranks' disjoint token shards (``moe_routed_shards``; None: mp)."""
    e, t, a = shape.experts, mp, PRECISIONS[precision].dtype.itemsize
    rows = micro_batch_size * shape.seq_len / cp
    local = rows / (routed_shards or t)  # the rows this rank dispatches
    gemms = [Gemm(local, e.count, shape.d_model)]  # the router (its bias, if any, is memory-bound)
    shared = 0.0
    for _ in range(e.shared):
        gemms += _linears(mlp_matrices(shape, shared_width(e), t), rows)
        shared += (3 if shape.mlp == "swiglu" else 2) * shared_width(e) / t
    per_expert = local * e.top_k * ep / e.count
    grouped = [Gemm(per_expert, out, inp, groups=e.count / ep) for inp, out in mlp_matrices(shape, e.width).values()]
    act = (3 if shape.mlp == "swiglu" else 2) * e.width
    elementwise = rows * shared * a + local * (e.top_k * (4 * shape.d_model + act) * a + 8 * e.count)
    matmul_forward = sum(g.flops for g in gemms + grouped)
    return LayerWork(tuple(gemms), tuple(grouped), elementwise_bytes=elementwise, counted_flops=3 * matmul_forward,
                     counted_forward_flops=matmul_forward)


def head_work(shape: DecoderShape, *, micro_batch_size: int, mp: int, cp: int, precision: str) -> LayerWork:
    """Final norm, LM head and cross-entropy over the vocabulary shard (the loss on sharded logits)."""
    a = PRECISIONS[precision].dtype.itemsize
    rows = micro_batch_size * shape.seq_len / cp
    vocab = -(-shape.vocab_size // mp)
    gemm = Gemm(rows, vocab, shape.d_model)
    # Logits written at a bytes, read and written as fp32 by the softmax forward and backward: a third forward.
    logits = rows * vocab * (2 * a + 12) + rows * shape.d_model * 4 * a
    return LayerWork((gemm,), elementwise_bytes=logits / 3, counted_flops=3 * gemm.flops,
                     counted_forward_flops=gemm.flops)


def mtp_input_work(shape: DecoderShape, *, micro_batch_size: int, cp: int, precision: str) -> LayerWork:
    """One MTP depth's input, besides its block and its pass through the head (models/common/mtp.py): the embedding's
    gather, three norms over d (read and written) and the [M, 2d] x [2d, d] projection (replicated over mp)."""
    a = PRECISIONS[precision].dtype.itemsize
    rows = micro_batch_size * shape.seq_len / cp
    gemm = Gemm(rows, shape.d_model, 2 * shape.d_model)
    return LayerWork((gemm,), elementwise_bytes=rows * shape.d_model * (a + 4 + 6 * a), counted_flops=3 * gemm.flops,
                     counted_forward_flops=gemm.flops)


def embedding_work(shape: DecoderShape, *, micro_batch_size: int, cp: int, precision: str) -> LayerWork:
    """A gather of rows (memory-bound)."""
    a = PRECISIONS[precision].dtype.itemsize
    rows = micro_batch_size * shape.seq_len / cp
    return LayerWork(elementwise_bytes=rows * shape.d_model * (a + 4))
