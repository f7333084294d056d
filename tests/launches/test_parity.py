"""fp32 parity: every mesh and schedule trains exactly like one process on the same global batch.

Every case compares the losses and global gradient norms of 2 AdamW steps **and every parameter's full
gradient after the first backward**. The losses alone cannot see a wrong reduction factor on a subset of
parameters: AdamW's update is invariant to a constant factor on one tensor's gradient, and such a tensor's
share of the global norm can be below any tolerance (a 1.5x gradient on one norm weight of a 2x1x4 SP run
moved the norm by 3e-5 relative and no loss at all)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from compiler.torch_compat import stages_receive_integer_tensors
from models import tied_weights
from runtime.commands.flags import parse_train_config
from tests.chat_data import CHAT_TOKENIZERS, shared_chat_file
from tests.launch import QUICK_RUN, spawn_ranks, train_each
from tests.lora_adapters import write_random_adapter
from tests.reference import train_reference
from tests.step_hook import after_backward

pytestmark = pytest.mark.slow  # real multi-process jobs

STEPS = 2
COMMON = ["--model", "tiny", "--precision", "fp32", "--steps", str(STEPS), "--micro-batch-size", "2",
          "--seq-len", "32", "--warmup-steps", "1", "--lr", "3e-3", "--log-every", "1", *QUICK_RUN]

LLAMA = ["--model", "llama3-debug", "--layers", "4", "--heads", "8", "--kv-heads", "4"]
DOCUMENTS = ["--document-mask", "--eod-token", "10"]
QWEN3 = ["--model", "qwen3-debug"]
QWEN3_MOE = ["--model", "qwen3-moe-debug", "--layers", "4"]  # 8 experts, top 2, auxiliary loss 0.001
MIXTRAL = ["--model", "mixtral-debug", "--layers", "4"]  # 8 experts, top 2, auxiliary loss 0.02
# 1 dense and 2 MoE blocks (8 experts in 4 groups, top 2, a shared expert, selection bias), latent attention with a q
# LoRA rank and YaRN
DEEPSEEK = ["--model", "deepseek-v3-debug"]
# 4 blocks alternating a sliding window of 8 and full attention, sinks, q/k/v/o biases, YaRN, 4 experts (top 2) with
# biases behind a biased router
GPT_OSS = ["--model", "gpt-oss-debug"]
# LoRA from random non-zero adapters (tests/lora_adapters.py; peft's zero B would give every A a zero first gradient)
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-from", "ADAPTER"]
# Chat data (SFT): conversations of mixed length (some truncated) rendered with Llama 3's template, packed into
# windows of 64 + 1 tokens under the document mask, the loss a mean over the global batch's assistant tokens.
# "{chat}" becomes tests/chat_data.py's shared file in _args.
SFT = ["--data", "{chat}", "--tokenizer", str(CHAT_TOKENIZERS / "llama3-style"), "--vocab-size", "2048",
       "--seq-len", "64"]

# (dp, pp, mp, schedule, extra flags): every mesh of the issue, every schedule, activation checkpointing (full
# and selective).
CASES = [
    (2, 2, 2, "interleaved-1f1b", []),
    # ... with the embedding and the head alone on stages of their own (what --split auto picks for a heavy head)
    # and packed documents (newline-separated in the built-in text): block-causal attention.
    (2, 2, 2, "interleaved-1f1b", ["--split", "manual:0,2,2,0", *DOCUMENTS]),
    (2, 1, 2, "interleaved-1f1b", []),
    (2, 2, 1, "naive", []),
    (4, 2, 1, "gpipe", []),
    (1, 2, 4, "zero-bubble", []),
    (2, 2, 2, "gpipe", ["--activation-checkpointing"]),
    # Untied embeddings (tied ones on two ranks, the embedding and head copies apart: the 1x2x1 cases below).
    (1, 2, 2, "1f1b", ["--untie-embeddings"]),
    # Data-parallel modes: replicate (with PP and TP), HSDP with PP and with TP, ZeRO-3.
    (2, 2, 2, "1f1b", ["--dp-shard", "1"]),
    (4, 2, 1, "interleaved-1f1b", ["--dp-shard", "2"]),
    # An odd vocabulary, as GPT-2's 50,257: uneven vocabulary shards, sharded again by FSDP.
    (4, 1, 2, "1f1b", ["--dp-shard", "2", "--vocab-size", "257"]),
    (2, 2, 2, "interleaved-1f1b", ["--reshard-after-forward"]),
    # The V placements (rank 0 holds the embedding and the tied head; the middle pair shares a rank) and
    # breadth-first looping. 1x4x1 needs 8 stages, so 8 blocks. Selective checkpointing under the split backward.
    # zbv with SP and replicated DP: W passes count the replicas' gradient accumulations.
    (2, 2, 2, "zbv", ["--sequence-parallel", "--dp-shard", "1"]),
    (1, 4, 1, "zbv", ["--layers", "8", "--activation-checkpointing", "selective"]),
    (1, 4, 1, "dualpipev", ["--layers", "8"]),
    (1, 4, 1, "looped-bfs", ["--layers", "8", "--activation-checkpointing"]),
    # Compiled blocks (inductor) under TP and PP.
    (1, 2, 2, "1f1b", ["--compile"]),
    # Sequence parallelism: norms and residual stream on sequence shards, also across stage boundaries, with
    # DP (and packed documents), under PP + selective AC (DTensor ops and the reduce-scatter kept), zbv (above),
    # and the embedding alone on a stage (it sends its slice of the sequence on).
    # (tokens, positions) inputs; no loss on the token after each end of document (the mean over every position)
    (2, 1, 4, "1f1b", [*DOCUMENTS, "--sequence-parallel", "--profile-memory", "--no-loss-across-documents"]),
    (2, 2, 2, "interleaved-1f1b", ["--sequence-parallel", "--activation-checkpointing", "selective"]),
    (2, 2, 2, "gpipe", ["--split", "manual:0,4", "--sequence-parallel"]),
    # Llama 3 (RMSNorm, RoPE with llama3 scaling, grouped-query attention 8 heads / 4 kv heads, SwiGLU): the
    # looped and V placements (zbv with packed documents: RoPE restarted per document), sequence parallelism
    # (the embedding reduce-scatters: nothing is added to it) under PP, and with TP over 2 ranks, HSDP and ZeRO-3.
    (2, 2, 2, "interleaved-1f1b", [*LLAMA, "--sequence-parallel"]),
    (2, 2, 2, "zbv", [*LLAMA, *DOCUMENTS]),
    (4, 1, 2, "1f1b", [*LLAMA, "--sequence-parallel", "--dp-shard", "2", "--reshard-after-forward"]),
    # Mixtures of experts (dropless top-2 of 8, the sequence-wise auxiliary loss, experts as FSDP units of their
    # own) with expert parallelism borrowed from dp: alone, under interleaved 1F1B with TP, over 4 ranks with SP
    # (each mp rank routes its own tokens), under zbv's split backward with AC, with HSDP + ZeRO-3; the bias
    # update with replicated dense parameters (experts sharded) and compiled blocks; Qwen3 dense (q/k norms,
    # explicit head_dim).
    # dense replicated, blocks compiled (the dispatch's data-dependent sizes break the graph; eager runs them)
    (2, 1, 1, "1f1b", [*QWEN3_MOE, "--ep", "2", "--expert-bias-rate", "0.01", "--dp-shard", "1", "--compile"]),
    (2, 2, 2, "interleaved-1f1b", [*QWEN3_MOE, "--ep", "2"]),
    (4, 1, 2, "1f1b", [*MIXTRAL, "--ep", "4", "--sequence-parallel"]),
    (2, 2, 1, "zbv", [*MIXTRAL, "--ep", "2", "--activation-checkpointing"]),
    (4, 2, 1, "interleaved-1f1b", [*QWEN3_MOE, "--ep", "2", "--dp-shard", "2", "--reshard-after-forward"]),
    (2, 2, 2, "1f1b", QWEN3),
    # Context parallelism (--cp in the flags: the world is dp x pp x cp x mp): each sequence in 2 cp load-balanced
    # chunks per rank, K/V all-gathered; learned positions, Llama's GQA with RoPE at global positions (and
    # selective AC), packed documents crossing chunk boundaries under interleaved PP + TP and under SP, and with
    # expert parallelism.
    (1, 1, 1, "1f1b", ["--cp", "2", "--eval-every", "2"]),  # validation on sequence chunks too
    (2, 1, 1, "1f1b", [*LLAMA, "--cp", "2", "--activation-checkpointing", "selective"]),
    (1, 2, 2, "interleaved-1f1b", ["--cp", "2", *DOCUMENTS]),
    (2, 1, 2, "1f1b", [*LLAMA, "--cp", "2", "--sequence-parallel", *DOCUMENTS, "--no-loss-across-documents"]),
    (2, 1, 1, "1f1b", [*QWEN3_MOE, "--cp", "2", "--ep", "2"]),
    # DeepSeek-V3's latent attention: TP (the shared RoPE key's gradient summed over mp), with SP (the replicated
    # down projections on the gathered sequence), under PP with EP, and with CP (values narrower than q and k). CP
    # gathers the latent and RoPE key (compiler/parallelize/latent_gather.py; 24 values a token against 112 for K/V
    # at mp 1, 56 at mp 2): alone, with TP (each rank's kv_b shard expanding the whole sequence; validation too),
    # with DP and selective recompute, with SP, packed documents and full recompute (the gather run again), and under
    # PP with documents and an MTP depth (its attention).
    (1, 1, 2, "1f1b", DEEPSEEK),
    (1, 1, 2, "1f1b", [*DEEPSEEK, "--sequence-parallel"]),
    (1, 1, 1, "1f1b", [*DEEPSEEK, "--cp", "2"]),
    (1, 1, 2, "1f1b", [*DEEPSEEK, "--cp", "2", "--eval-every", "2"]),
    (2, 1, 1, "1f1b", [*DEEPSEEK, "--cp", "2", "--activation-checkpointing", "selective"]),
    (1, 1, 2, "1f1b", [*DEEPSEEK, "--cp", "2", "--sequence-parallel", *DOCUMENTS, "--activation-checkpointing"]),
    (1, 2, 1, "1f1b", [*DEEPSEEK, "--cp", "2", *DOCUMENTS, "--mtp-depth", "1"]),
    (2, 2, 2, "interleaved-1f1b", [*DEEPSEEK, "--layers", "4", "--ep", "2", "--sequence-parallel"]),
    # gpt-oss (sinks split with the heads, o's bias added once after the row-parallel sum, experts' biases with their
    # experts): 2x2x2 with EP and SP; CP with packed documents and a window shorter than a chunk (T 64: chunks of 16;
    # selective AC keeping the banded attention's outputs: the sliding layers exchange halos) and one longer (T 16:
    # chunks of 4, the window reaching into the other rank's chunk: all-gathered); cp 4 x pp 2 interleaved with
    # documents (T 64: chunks of 8, halos from both neighbours on the middle ranks); zbv's split backward with EP.
    (2, 2, 2, "interleaved-1f1b", [*GPT_OSS, "--ep", "2", "--sequence-parallel"]),
    (1, 1, 2, "1f1b", [*GPT_OSS, "--cp", "2", *DOCUMENTS, "--seq-len", "64", "--activation-checkpointing", "selective"]),
    (1, 1, 2, "1f1b", [*GPT_OSS, "--cp", "2", *DOCUMENTS, "--seq-len", "16"]),
    (1, 2, 1, "interleaved-1f1b", [*GPT_OSS, "--cp", "4", *DOCUMENTS, "--seq-len", "64"]),
    (2, 2, 1, "zbv", [*GPT_OSS, "--ep", "2", "--mtp-depth", "1"]),  # with an MTP depth: gpt-oss block L
    # Multi-token prediction (DeepSeek-V3 sec. 2.2): the depths on the last stage, their embedding a third copy of the
    # tied one, with SP and ZeRO-3 over 2x2x2 (the loss gathers the stage's resharded head); Llama's RoPE with depth 2
    # over pp 2 x cp 2 and packed documents (shifted tokens read across chunks, no prediction across a boundary or
    # after an end of document; validation without the depths); DeepSeek's MoE depth with EP, TP and replicated dense
    # parameters, no q LoRA rank (16b's shape); the V placements (the last stage on pp rank 0), with two depths under
    # zbv (a split backward cannot split that stage's: its input pass runs the whole, its weight pass nothing).
    (2, 2, 2, "interleaved-1f1b", ["--mtp-depth", "1", "--sequence-parallel", "--reshard-after-forward"]),
    (1, 2, 1, "interleaved-1f1b", [*LLAMA, "--cp", "2", *DOCUMENTS, "--no-loss-across-documents", "--mtp-depth", "2",
                                   "--eval-every", "2"]),
    (2, 1, 2, "1f1b", ["--model", "deepseek-v3-16b-debug", "--ep", "2", "--dp-shard", "1", "--mtp-depth", "1"]),
    (1, 2, 1, "zbv", [*DEEPSEEK, "--layers", "4", "--mtp-depth", "2"]),
    (1, 2, 1, "dualpipev", ["--mtp-depth", "1"]),
    # Validation through the V placements (a forward-only action list: torch's V schedules cannot eval()).
    (1, 2, 1, "zbv", ["--eval-every", "2"]),
    (1, 2, 1, "dualpipev", ["--eval-every", "2"]),
    (1, 2, 1, "interleaved-1f1b", ["--eval-every", "2"]),
    # LoRA (the base frozen: no gradient, no AdamW state): adapters sharded with their column- and row-parallel
    # bases under SP, one per expert under EP, and GPT-2's fused q/k/v with biases under zbv and replicated DP.
    (2, 2, 2, "interleaved-1f1b", [*LLAMA, "--sequence-parallel", *LORA]),
    (2, 1, 2, "1f1b", [*QWEN3_MOE, "--ep", "2", *LORA, "--lora-targets", "q,k,v,o,experts"]),
    (2, 2, 2, "zbv", [*LORA, "--dp-shard", "1"]),
    # SFT: packed conversations under interleaved PP with TP and SP, and split over cp ranks (validation too).
    (2, 2, 2, "interleaved-1f1b", [*SFT, "--sequence-parallel"]),
    (1, 1, 2, "1f1b", [*SFT, "--cp", "2", "--eval-every", "2"]),
]
if not stages_receive_integer_tensors():  # torch 2.11: --document-mask with --pp > 1 is refused (runtime/config.py)
    CASES = [c for c in CASES if c[1] == 1 or not ("--document-mask" in c[4] or c[4][:len(SFT)] == SFT)]


def _args(dp, pp, mp, schedule, extra, logdir) -> list[str]:
    extra = [f"{logdir}-adapter" if x == "ADAPTER" else x for x in extra]  # written by the ``trained`` fixture
    extra = [str(shared_chat_file()) if x == "{chat}" else x for x in extra]
    return [f"--dp={dp}", f"--pp={pp}", f"--mp={mp}", "--schedule", schedule, "--microbatches", str(2 * pp),
            "--logdir", str(logdir), *COMMON, *extra]


def case_world(case) -> int:
    """Processes a case launches: dp x pp x mp, times --cp when given."""
    dp, pp, mp, _, extra = case
    return dp * pp * mp * (int(extra[extra.index("--cp") + 1]) if "--cp" in extra else 1)


def _case_id(case) -> str:
    dp, pp, mp, schedule, extra = case
    sft = extra[:len(SFT)] == SFT
    extra = ["--sft"] * sft + extra[len(SFT) * sft:]
    # shape flags say nothing the family does not, nor LoRA's settings
    flags = [x for x in extra if x not in LLAMA[2:] + LORA[1:] and x not in ("10", "4")]
    return f"{dp}x{pp}x{mp}-{schedule}" + "".join(f"-{x.removeprefix('--').replace(',', '')}" for x in flags)


CASES_BY_ID = {_case_id(c): c for c in CASES}
VALIDATION_CASES = [(1, 2, 1, schedule, ["--eval-every", "2"]) for schedule in ("zbv", "dualpipev", "interleaved-1f1b")]


def _selected_cases(session) -> list:
    """The cases the session's selected tests read (``pytest -k <id>`` runs just that case's job): a test of one
    case names it in its parameters; the validation comparison reads ``VALIDATION_CASES``."""
    ids = set()
    for item in session.items:
        if item.module.__name__ != __name__ or "trained" not in item.fixturenames:
            continue
        params = getattr(item, "callspec", None) and item.callspec.params
        if not params:
            ids.update(_case_id(c) for c in VALIDATION_CASES)
            continue
        case = params.get("case") or tuple(params[k] for k in ("dp", "pp", "mp", "schedule", "extra"))
        ids.add(_case_id(case))
    return [c for c in CASES if _case_id(c) in ids]


@pytest.fixture(scope="module")
def trained(request, tmp_path_factory) -> dict[str, tuple[Path, str | None]]:
    """Case id -> (its logdir, the error of its job or None): one spawned job per world size, of the cases the
    selected tests read."""
    root = tmp_path_factory.mktemp("parity")
    by_world: dict[int, list[str]] = {}
    for case in _selected_cases(request.session):
        by_world.setdefault(case_world(case), []).append(_case_id(case))
    out = {}
    for world, ids in by_world.items():
        argvs = [_args(*CASES_BY_ID[i], root / i) for i in ids]
        for argv in (a for a in argvs if "--lora-from" in a):
            write_random_adapter(argv[argv.index("--lora-from") + 1], argv)
        try:
            spawn_ranks(train_each_dumping_gradients, world_size=world, args=(argvs, [str(root / i) for i in ids]),
                        timeout=60 + 90 * len(ids))
            error = None
        except AssertionError as e:
            error = f"the {world}-rank job of cases {ids} failed:\n{str(e)[-4000:]}"
        out.update({i: (root / i, error) for i in ids})
    return out


@pytest.mark.parametrize("dp,pp,mp,schedule,extra", CASES, ids=[_case_id(c) for c in CASES])
def test_losses_and_gradients_match_single_process(trained, dp, pp, mp, schedule, extra):
    logdir, error = trained[_case_id((dp, pp, mp, schedule, extra))]
    assert error is None, error
    summary = json.loads((logdir / "summary.json").read_text())

    world = case_world((dp, pp, mp, schedule, extra))
    cfg = parse_train_config(_args(dp, pp, mp, schedule, extra, logdir), world_size=world)
    reference = train_reference(cfg, steps=STEPS)
    assert_gradients_match(gathered_gradients(logdir, world_size=world, tied=tied_weights(cfg.model)),
                           reference.first_step_grads)
    assert len(summary["losses"]) == STEPS
    for step, (got, want) in enumerate(zip(summary["losses"], reference.losses)):
        assert got == pytest.approx(want, rel=1e-4), f"step {step}: mesh loss {got} vs single process {want}"
    assert summary["mtp_losses"] == pytest.approx(reference.mtp_losses, rel=1e-4)  # the depths' part ([]: none)
    for step, (got, want) in enumerate(zip(summary["grad_norms"], reference.grad_norms)):
        assert got == pytest.approx(want, rel=1e-4), f"step {step}: global grad norm {got} vs {want}"
    if cfg.data.eval_every:  # the validation after the last step: the same weights on the same rows
        assert summary["final_val_loss"] == pytest.approx(reference.final_val_loss, rel=1e-4)


def train_each_dumping_gradients(argvs: list[list[str]], out_dirs: list[str]) -> None:
    """``train_each`` whose first step of every run saves each rank's parameters' full gradients (after the
    schedule's backward, the tied-copy sums and the replicas' reductions; before unscaling and clipping) to
    ``<out_dir>/grads_rank<r>.pt``."""
    first_steps = iter(out_dirs)  # the runs go in order, each with one first step

    def dump(step: int, ctx) -> None:
        if step == 0:
            _dump_full_gradients(next(first_steps), ctx.stages, ctx.optimizer)

    after_backward(dump)
    train_each(argvs)


def _dump_full_gradients(out_dir: str, stages, optimizer) -> None:
    import torch.distributed as dist

    grads = {}
    for name, param in stages.named_parameters():
        if not param.requires_grad:  # LoRA's base, a router's selection bias: frozen, or moved by their own rule
            assert param.grad is None and not optimizer.state.get(param), f"frozen {name} has a gradient or AdamW state"
            continue
        # full_tensor() is a collective over the parameter's mesh (its dp and mp peers hold the same
        # stages, so they run the same sequence of these). The local gradient is read with the parameter's
        # placements, as the optimizer reads it: a gradient left Partial (a sum not yet taken) must fail here.
        grad = param.grad
        if isinstance(grad, DTensor):
            grad = DTensor.from_local(grad.to_local(), grad.device_mesh, param.placements, run_check=False,
                                      shape=grad.shape, stride=grad.stride()).full_tensor()
        grads[name] = None if grad is None else grad.detach().clone()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    torch.save(grads, f"{out_dir}/grads_rank{dist.get_rank()}.pt")
    # What each stage receives from the previous one: the shapes of the buffers torch's stage receives
    # activations into (a message of another size fails the transfer).
    received = {index: [tuple(info.buffer.shape) for info in stage.args_recv_info[0]
                        if getattr(info, "buffer", None) is not None and info.buffer.is_floating_point()]
                for index, stage in zip(stages.indices, stages.stages)}
    (Path(out_dir) / f"received_rank{dist.get_rank()}.json").write_text(json.dumps(received))


def gathered_gradients(out_dir: Path, *, world_size: int, tied: dict[str, str]) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient, by the model's parameter name, from every rank's dump; the copies
    held by dp and mp peers and a tied weight's two copies (``tied``: {copy: source}) must agree exactly."""
    seen: dict[str, torch.Tensor] = {}
    for rank in range(world_size):
        for name, grad in torch.load(out_dir / f"grads_rank{rank}.pt").items():
            assert grad is not None, f"rank {rank}: {name} got no gradient"
            name = tied.get(name, name)  # the head's copy of the tied embedding holds its gradient too
            if name in seen:
                torch.testing.assert_close(grad, seen[name], rtol=0, atol=0,
                                           msg=lambda m: f"rank {rank}'s copy of {name} differs: {m}")
            seen[name] = grad
    return seen


def assert_gradients_match(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, rtol: float = 1e-5) -> None:
    """Each parameter's gradient equals the single-process one within ``rtol`` of that tensor's largest
    entry (elementwise, so a wrong factor on any tensor, however small, fails)."""
    assert set(got) == set(want), f"parameters missing {set(want) - set(got)}, extra {set(got) - set(want)}"
    for name, reference in want.items():
        scale = float(reference.abs().max())
        torch.testing.assert_close(got[name], reference, rtol=rtol, atol=rtol * scale,
                                   msg=lambda m: f"gradient of {name}: {m}")


@pytest.mark.parametrize("case", [c for c in CASES if "--sequence-parallel" in c[4] and c[1] > 1], ids=_case_id)
def test_sequence_parallel_stages_exchange_sequence_shards(trained, case):
    """Under SP the residual stream stays on sequence shards between stages (Megatron-LM): every stage after
    the first receives (micro-batch, T/mp, d) activations, 1/mp of a whole sequence's bytes."""
    dp, pp, mp, _, _ = case
    logdir, error = trained[_case_id(case)]
    assert error is None, error
    cfg = parse_train_config(_args(*case, logdir), world_size=case_world(case))
    shard = [cfg.plan.micro_batch_size, cfg.model.seq_len // cfg.plan.cp // mp, cfg.model.d_model]
    received = {}
    for rank in range(case_world(case)):
        received.update(json.loads((logdir / f"received_rank{rank}.json").read_text()))
    assert sorted(int(i) for i in received) == list(range(pp * cfg.plan.stages_per_rank))
    for index, shapes in received.items():
        assert shapes == ([] if index == "0" else [shard]), f"stage {index} receives {shapes}, expected {shard}"


def test_validation_is_the_same_through_every_placement(trained):
    """The V schedules validate through a forward-only pass; interleaved 1F1B through torch's eval(): the same
    weights (parity above) must give the same validation loss."""
    values = {}
    for case in VALIDATION_CASES:
        schedule = case[3]
        logdir, error = trained[_case_id(case)]
        assert error is None, error
        values[schedule] = json.loads((logdir / "summary.json").read_text())["final_val_loss"]
    assert values["zbv"] == pytest.approx(values["interleaved-1f1b"], rel=1e-5)
    assert values["dualpipev"] == pytest.approx(values["interleaved-1f1b"], rel=1e-5)
