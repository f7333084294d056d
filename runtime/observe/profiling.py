"""Where a step's time goes, per rank: timing hooks around pipeline actions and collectives.

Spans nest on the main thread, and each category is charged its *exclusive* time (a tensor-parallel
all-reduce inside a forward pass counts as TP communication, not as forward compute):

- ``forward`` / ``backward``: a stage's forward, full backward (B), input-gradient (I) and
  weight-gradient (W) passes, from ``PipelineStage`` methods;
- ``pp_send_recv``: posting point-to-point sends/receives and waiting for sends to complete;
- ``idle``: waiting for a pipeline neighbour's activation or gradient to arrive. This is the bubble:
  the rank has nothing to compute until its neighbour delivers (on gloo the transfer itself is
  inside this wait and cannot be separated from it);
- ``tp_comm``: DTensor redistributions (Megatron's all-reduces) and their deferred waits;
- ``dp_comm``: FSDP all-gathers (unshard and its wait) and reduce-scatters (post-backward);
- ``optimizer``: unscale, global grad-norm all-reduce, clipping, AdamW, scaler update;
- ``other``: the rest of the step (schedule bookkeeping, the loss function, Python overhead).

The hooks patch a handful of torch functions while profiling is on and restore them afterwards.

On an accelerator the host runs ahead of the device and NCCL's ``Work.wait()`` only makes the compute stream
wait, so host clocks around a span would time kernel launches. While a step is profiled every span
therefore synchronises the current stream when it opens and when it closes (Megatron's timers synchronise
the device the same way): a span's time is then its kernels' time, and a receive's wait lasts until the
data is there. Only the compute stream is synchronised, so a transfer NCCL or FSDP runs on a stream of its
own is charged where the compute stream waits for it (the receive's ``wait``, FSDP's ``wait_for_unshard``),
not where it is posted. Profiled steps lose the host's run-ahead; the others are untouched.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from compiler.torch_compat import FUNCTIONAL_WAIT, P2P_BATCH, REDISTRIBUTE, SCHEDULE_LOSS, FSDPParamGroup

CATEGORIES = ("forward", "backward", "pp_send_recv", "idle", "tp_comm", "dp_comm", "optimizer", "other")


@dataclass
class Span:
    category: str
    name: str
    start: float  # seconds since the step began
    end: float
    depth: int
    args: dict = field(default_factory=dict)


@dataclass
class StepProfile:
    rank: int
    step_time: float
    spans: list[Span]
    exclusive: dict[str, float]  # seconds per category; sums to step_time (``other`` closes the gap)

    def to_dict(self) -> dict:
        return {"rank": self.rank, "step_time": self.step_time, "exclusive": self.exclusive,
                "spans": [vars(s) for s in self.spans]}


class StepRecorder:
    """Collects nested spans during the steps being profiled; costs one ``if`` when inactive."""

    def __init__(self, rank: int, *, sync: Callable[[], None] | None = None):
        """``sync``: blocks until the device has run what the host queued (None on the CPU)."""
        self.rank = rank
        self._sync = sync or (lambda: None)
        self.active = False
        self._t0 = 0.0
        self._stack: list[list] = []  # [span, children_seconds]
        self._spans: list[Span] = []
        self._exclusive: dict[str, float] = {}

    def begin_step(self) -> None:
        self._sync()
        self.active, self._t0, self._spans, self._stack = True, time.perf_counter(), [], []
        self._exclusive = dict.fromkeys(CATEGORIES, 0.0)

    def end_step(self) -> StepProfile:
        self._sync()
        step_time = time.perf_counter() - self._t0
        self.active = False
        tracked = sum(v for k, v in self._exclusive.items() if k != "other")
        self._exclusive["other"] = max(0.0, step_time - tracked)
        return StepProfile(self.rank, step_time, self._spans, self._exclusive)

    @contextlib.contextmanager
    def span(self, category: str, name: str, **args) -> Iterator[None]:
        if not self.active:
            yield
            return
        self._sync()  # what was queued before the span is not the span's
        start = time.perf_counter() - self._t0
        entry = [Span(category, name, start, start, len(self._stack), args), 0.0]
        self._stack.append(entry)
        try:
            yield
        finally:
            self._sync()
            self._stack.pop()
            span, children = entry
            span.end = time.perf_counter() - self._t0
            duration = span.end - span.start
            self._exclusive[category] += duration - children
            if self._stack:
                self._stack[-1][1] += duration
            self._spans.append(span)


class _Patches:
    """Replace attributes and put the originals back on ``restore``."""

    def __init__(self):
        self._saved: list[tuple[object, str, object]] = []

    def wrap(self, owner: object, name: str, make: Callable[[Callable], Callable]) -> None:
        original = getattr(owner, name)
        self._saved.append((owner, name, original))
        setattr(owner, name, make(original))

    def restore(self) -> None:
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)


class _TimedWork:
    """A p2p Work whose ``wait`` is charged to idle (it receives) or pp_send_recv (it only sends)."""

    def __init__(self, work, *, receives: bool, sends: bool, recorder: StepRecorder):
        self._work, self._recorder = work, recorder
        self._category = "idle" if receives else "pp_send_recv"
        self._name = "send/recv wait" if receives and sends else "recv wait" if receives else "send wait"

    def wait(self, *args, **kwargs):
        with self._recorder.span(self._category, self._name):
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def timed_p2p(recorder: StepRecorder) -> Callable[[Callable], Callable]:
    """Wrap the schedules' ``_batch_p2p(p2p_ops, desc)``: posting is pp_send_recv, each returned work's wait
    idle or pp_send_recv. gloo returns one work per operation (and so does 2.13 for an all-send or
    all-receive batch); NCCL coalesces a batch into ONE work (``batch_isend_irecv``), whose wait covers every
    operation in it, so it is a wait for a neighbour whenever the batch receives anything."""
    import torch.distributed as dist

    def make(fn):
        def wrapper(p2p_ops, desc=None):
            with recorder.span("pp_send_recv", "post p2p"):
                works = fn(p2p_ops, desc)
            if not recorder.active:
                return works
            if len(works) == len(p2p_ops):
                return [_TimedWork(w, receives=op.op is dist.irecv, sends=op.op is dist.isend, recorder=recorder)
                        for w, op in zip(works, p2p_ops)]
            receives, sends = any(op.op is dist.irecv for op in p2p_ops), any(op.op is dist.isend for op in p2p_ops)
            return [_TimedWork(w, receives=receives, sends=sends, recorder=recorder) for w in works]
        return wrapper
    return make


def install_hooks(recorder: StepRecorder, stages: list, schedule) -> _Patches:
    """Instrument this rank's PipelineStages, loss, pipeline p2p, DTensor and FSDP collectives."""
    patches = _Patches()

    def timed(category: str, label: Callable[..., str]):
        def make(fn):
            def wrapper(*args, **kwargs):
                with recorder.span(category, label(*args, **kwargs)):
                    return fn(*args, **kwargs)
            return wrapper
        return make

    for stage in stages:
        s = stage.stage_index
        patches.wrap(stage, "forward_one_chunk", _stage_hook(recorder, "forward", "F", s))
        patches.wrap(stage, "backward_one_chunk", _stage_hook(recorder, "backward", None, s))
        patches.wrap(stage, "backward_weight_one_chunk", _stage_hook(recorder, "backward", "W", s))

    # The schedule computes the loss outside the last stage's forward; it is forward work too.
    patches.wrap(schedule, SCHEDULE_LOSS, timed("forward", lambda *a, **k: "loss"))

    patches.wrap(*P2P_BATCH, timed_p2p(recorder))
    for owner, name in REDISTRIBUTE:
        patches.wrap(owner, name, timed("tp_comm", lambda *a, **k: "redistribute"))
    patches.wrap(*FUNCTIONAL_WAIT, timed("tp_comm", lambda *a, **k: "collective wait"))
    patches.wrap(FSDPParamGroup, "unshard", timed("dp_comm", lambda *a, **k: "all-gather"))
    patches.wrap(FSDPParamGroup, "wait_for_unshard", timed("dp_comm", lambda *a, **k: "all-gather wait"))
    patches.wrap(FSDPParamGroup, "post_backward", timed("dp_comm", lambda *a, **k: "reduce-scatter"))
    return patches


def _stage_hook(recorder: StepRecorder, category: str, kind: str | None, stage_index: int):
    def make(fn):
        def wrapper(chunk_id, *args, **kwargs):
            # backward_one_chunk(full_backward=False) is the input-gradient half (I) of a zero-bubble B.
            name = kind or ("B" if kwargs.get("full_backward", True) else "I")
            with recorder.span(category, f"{name}{chunk_id}", kind=name, stage=stage_index, microbatch=chunk_id):
                return fn(chunk_id, *args, **kwargs)
        return wrapper
    return make


class Profiler:
    """Profiles chosen steps of a run: barrier-aligned start, hooks installed for the run's lifetime."""

    def __init__(self, *, rank: int, stages: list, schedule, steps: set[int], sync: Callable[[], None] | None = None):
        self.recorder = StepRecorder(rank, sync=sync)
        self.steps = steps
        self.profiles: list[StepProfile] = []
        self._patches = install_hooks(self.recorder, stages, schedule)

    def wants(self, step: int) -> bool:
        return step in self.steps

    def begin(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()  # all ranks start the profiled step together: one time origin
        self.recorder.begin_step()

    def end(self) -> None:
        self.profiles.append(self.recorder.end_step())

    def close(self) -> None:
        self._patches.restore()


def profiled_steps(total_steps: int, count: int = 3) -> set[int]:
    """The last ``count`` steps (past the warm-up steps whenever the run is long enough)."""
    return set(range(max(0, total_steps - count), total_steps))
