"""Time split, Chrome trace and Gantt image from step profiles."""

import json
import struct
import zlib

import pytest
import torch

from runtime.observe.png import write_png
from runtime.observe.profiling import Span, StepProfile, StepRecorder
from runtime.observe.timeline import chrome_trace, render_gantt, time_split


def _profile(rank):
    recorder = StepRecorder(rank)
    recorder.begin_step()
    with recorder.span("forward", "F0", kind="F", stage=rank, microbatch=0):
        with recorder.span("tp_comm", "redistribute"):
            pass
    with recorder.span("idle", "recv wait"):
        pass
    with recorder.span("backward", "B0", kind="B", stage=rank, microbatch=0):
        pass
    return recorder.end_step()


def test_exclusive_times_add_up_to_the_step():
    profile = _profile(0)
    split = time_split(profile)
    assert sum(split[k] for k in ("forward", "backward", "pp_send_recv", "idle", "tp_comm", "dp_comm",
                                  "optimizer", "other")) == pytest.approx(profile.step_time, rel=1e-9)
    nested = next(s for s in profile.spans if s.category == "tp_comm")
    assert nested.depth == 1


def test_chrome_trace_has_one_track_per_rank():
    trace = chrome_trace([_profile(0), _profile(1)], rank_labels={0: "rank 0", 1: "rank 1"})
    json.dumps(trace)
    tracks = {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert tracks == {0, 1}
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"]
    assert names == ["rank 0", "rank 1"]


def test_gantt_draws_actions_in_their_colours_and_png_roundtrips(tmp_path):
    profile = StepProfile(0, 1.0, [Span("forward", "F0", 0.0, 0.5, 0, {"kind": "F", "microbatch": 0}),
                                   Span("backward", "B0", 0.5, 1.0, 0, {"kind": "B", "microbatch": 0})], {})
    image = render_gantt([profile], width=100)
    assert image.dtype == torch.uint8 and image.shape[2] == 3
    row = image[image.shape[0] // 2]
    assert tuple(row[22 + 25].tolist()) == (66, 133, 244)  # forward blue
    assert tuple(row[22 + 75].tolist()) == (52, 168, 83)  # backward green
    write_png(image, tmp_path / "g.png")
    data = (tmp_path / "g.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (height, width) == tuple(image.shape[:2])
    idat = data[data.index(b"IDAT") + 4:data.index(b"IEND") - 8]
    raw = zlib.decompress(idat)
    assert len(raw) == height * (1 + width * 3)
