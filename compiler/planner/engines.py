"""What the priced engine does where engines differ: one row of traits each.

The planner prices this engine by default (``THIS_ENGINE``). A published run is priced with the traits of
the engine that ran it (compiler/published/*.json name one of ``ENGINES``), so that the device and network
are what is being checked, not our engine's choices: Megatron-LM 2021 (Narayanan et al. SC'21), Megatron-Core
of today, Meta's Llama 3 stack and torchtitan. A trait is a fact about that engine stated in its paper or
source, never a number fitted to its results.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from compiler.planner.candidates import Constraints

EP_DISPATCHES = ("all-to-all", "deepep")


@dataclass(frozen=True)
class EngineTraits:
    name: str = "this engine"
    # "flash" (FlashAttention-2: PyTorch's SDPA) | "fused" (Transformer Engine: cuDNN's fused attention where
    # the device has it, devices.py ``fused_attention_speedup``, else flash) | "materialized" (T x T scores in
    # HBM, Megatron-LM 2021)
    attention: str = "flash"
    activations: str = "engine"  # saved-tensor layout: "engine" | "megatron" (compiler/planner/activations.py)
    p2p_scatter_gather: bool = False  # pipeline messages split over the TP ranks (Megatron's scatter/gather)
    dp_overlap: bool = True  # gradient reduction and parameter gathers overlap compute (where the device can)
    grad_reduce_bytes: int = 4  # data-parallel gradients travel in fp32 (--reduce-dtype fp32) or 2 bytes
    tp_overlap: bool = False  # TP collectives hidden behind the matrix products (async TP, TE comm overlap)
    float8_linears: bool = False  # linear layers' products at the device's fp8 peak (torchao Float8, TE fp8)
    # FSDP gathers the FP8 weights of FP8 products (torchao's enable_fsdp_float8_all_gather): 1 byte a parameter.
    # This engine gathers in the precision unless a plan asks for ``--fp8-all-gather`` (ParallelPlan.fp8_all_gather:
    # its FP8 linears' weights in e4m3, compiler/fp8/fsdp_all_gather.py; step.py prices the dense weights so, and
    # memory_model.py holds the Float8 linears' gathered weights so, float8_weights.py).
    fp8_all_gather: bool = False
    sp_messages: bool = True  # under sequence parallelism pipeline messages are (B, T/mp, D) shards
    # A MoE layer under TP routes its TP group's disjoint sequence shards (expert TP 1; Megatron requires SP with
    # MoE and TP); this engine does so under SP only: without it every TP rank routes all the tokens
    # (compiler/parallelize/expert_parallel.py), the same rows mp times.
    moe_shards_need_sp: bool = False
    # How MoE tokens reach their experts (compiler/planner/layers.py): "all-to-all" sends one copy per
    # (token, expert) pair (this engine, Megatron's alltoall dispatcher); "deepep" one per destination rank,
    # and across nodes one per destination node, forwarded over NVLink there (DeepEP's normal kernels).
    ep_dispatch: str = "all-to-all"  # one of EP_DISPATCHES
    # Ranks are numbered by these mesh dimensions, outermost first (the innermost is contiguous): which
    # groups share a node. The engine builds (dp, pp, mp); Megatron orders tp, cp, dp, pp from the inside.
    mesh_order: tuple[str, ...] = ("dp", "pp", "cp", "mp")
    # What the engine can run at all (a published run is searched within it): sequence parallelism,
    # selective recompute, the chunked loss.
    has_sequence_parallel: bool = True
    has_selective_ac: bool = True
    has_chunked_loss: bool = True
    # What selective recompute keeps of a block (compiler/planner/activations.py): "products" every matrix
    # product's output (Megatron's --recompute-modules norm/act, this engine's kept ops); "every-other-mm" the
    # outputs of the 1st, 3rd, ... mm in execution order and attention's, the rest recomputed (torchtitan's
    # op-level policy, torchtitan/distributed/activation_checkpoint.py ``_custom_policy``); "products+moe" as
    # "products" for attention, while a MoE block's MLP keeps only its input and runs again whole in the
    # backward, router, experts and all-to-alls (Megatron's --recompute-modules moe).
    selective_policy: str = "products"
    # Stages beyond the blocks the engine's split allows (Megatron-Core's --account-for-embedding-in-pipeline-
    # split and -loss-: the embedding and the loss count as layers, 2); this engine's rule is pp x v <= layers.
    extra_stages: int = 0
    # Under CP a sliding-window layer whose window reaches only the previous chunk exchanges W - 1 keys with each
    # neighbour rank instead of all-gathering K and V (compiler/parallelize/halo.py); the published engines gather.
    cp_halos: bool = False
    # ZeRO-3 (parameters resharded after the forward) under a split-backward schedule: this engine's FSDP reduces and
    # reshards before the weight pass (compiler/schedules.py ``zero3_problem``); the published engines' are searched.
    zero3_split_backward: bool = True

    @property
    def recomputes_moe(self) -> bool:
        """Selective recompute runs a MoE block's whole MLP again (its products and all-to-alls too)."""
        return self.selective_policy == "products+moe"

    @property
    def selective_matmul_recompute(self) -> float:
        """The fraction of a block's matrix products selective recompute runs again."""
        return 0.5 if self.selective_policy == "every-other-mm" else 0.0

    def limits(self, given: "Constraints") -> "Constraints":
        """``given`` with what this engine cannot run fixed off."""
        sp = given.sequence_parallel if self.has_sequence_parallel else False
        chunked = given.chunked_loss if self.has_chunked_loss else False
        modes = given.ac_modes or (("none", "selective", "full") if self.has_selective_ac else ("none", "full"))
        return replace(given, sequence_parallel=sp, chunked_loss=chunked, ac_modes=modes)

    def strides(self, sizes: dict[str, int]) -> dict[str, int]:
        """Rank distance between neighbours of each dimension."""
        out, stride = {}, 1
        for dim in reversed(self.mesh_order):
            out[dim] = stride
            stride *= sizes.get(dim, 1)
        return out


THIS_ENGINE = EngineTraits(cp_halos=True, moe_shards_need_sp=True, zero3_split_backward=False)

# Narayanan et al. 2021 (SC'21, Megatron-LM): materialised attention with a fused softmax kernel, the
# scatter/gather optimisation of pipeline messages (sec. 4.1), the data-parallel all-reduce after the
# backward pass, and fp16 gradients (--accumulate-allreduce-grads-in-fp32 was off by default).
# Sequence parallelism and selective recompute came later (Korthikanti et al. 2022).
MEGATRON_2021 = EngineTraits("Megatron-LM 2021", attention="materialized", activations="megatron",
                             p2p_scatter_gather=True, dp_overlap=False, grad_reduce_bytes=2,
                             mesh_order=("pp", "dp", "cp", "mp"), has_sequence_parallel=False,
                             has_selective_ac=False, has_chunked_loss=False)

# Megatron-Core (2024-): attention through Transformer Engine (cuDNN's fused kernel on Hopper+), the
# distributed optimizer's reduce-scatter and all-gather overlapped with compute (--overlap-grad-reduce
# --overlap-param-gather), fp32 gradient buckets, sequence parallelism with TP, TP communication overlapped
# (--tp-comm-overlap).
MEGATRON_CORE = EngineTraits("Megatron-Core", attention="fused", activations="megatron", dp_overlap=True,
                             grad_reduce_bytes=4, tp_overlap=True, mesh_order=("pp", "dp", "cp", "mp"),
                             has_chunked_loss=False, extra_stages=2)

# Dubey et al. 2024 (The Llama 3 Herd of Models, sec. 3.3): 4D parallelism ordered [TP, CP, PP, DP] from the
# inside, FSDP that shards optimizer states and gradients but keeps parameters after the forward, bf16.
META_LLAMA3 = EngineTraits("Meta Llama 3", attention="flash", activations="megatron", dp_overlap=True,
                           grad_reduce_bytes=4, mesh_order=("dp", "pp", "cp", "mp"), has_chunked_loss=False)

# torchtitan (docs/performance.md at eaea6f6): FSDP2, TP with sequence parallelism, Float8 linears where its
# rows say so, async TP where they say so.
# Its selective AC ("op") saves every other mm's output (torchtitan/distributed/activation_checkpoint.py).
TORCHTITAN = EngineTraits("torchtitan", attention="flash", activations="megatron", dp_overlap=True,
                          grad_reduce_bytes=4, mesh_order=("dp", "pp", "cp", "mp"), has_chunked_loss=False,
                          selective_policy="every-other-mm")

ENGINES = {"this": THIS_ENGINE, "megatron-2021": MEGATRON_2021, "megatron-core": MEGATRON_CORE,
           "meta-llama3": META_LLAMA3, "torchtitan": TORCHTITAN}
