"""The planner notices a calibration from another CPU and re-measures each precision (or says it cannot
predict). The benchmark itself is replaced by a stand-in reporting chosen times, so the test checks the
decision and the arithmetic, not this machine's speed."""

from __future__ import annotations

import dataclasses

import pytest

from compiler.planner import precision_probe
from compiler.planner.cluster import load_cluster
from compiler.planner.cpu_identity import cpu_identity, identity_difference
from runtime.commands import auto
from runtime.commands.flags import build_parser

ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx fma f16c avx2 bmi2

processor\t: 1
vendor_id\t: AuthenticAMD
"""


def test_cpu_identity_reads_the_first_processor(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(ZEN3)
    identity = cpu_identity(path)
    assert identity == {"vendor": "AuthenticAMD", "model_name": "AMD EPYC", "family": 25, "model": 1,
                        "flags": ["avx2", "f16c", "fma"]}
    assert "machine" in cpu_identity(tmp_path / "missing")


def test_differences_are_in_the_flags_that_decide_precision_speed():
    calibrated = {"vendor": "AuthenticAMD", "family": 25, "flags": ["avx2", "avx512_bf16", "avx512f", "f16c", "fma"]}
    here = {"vendor": "AuthenticAMD", "family": 25, "model": 1, "model_name": "AMD EPYC", "flags": ["avx2", "f16c", "fma"]}
    assert identity_difference(calibrated, here) == "no avx512_bf16 avx512f here"
    assert identity_difference(calibrated, {**here, "flags": calibrated["flags"]}) is None  # model not recorded


def _cluster_calibrated_on(identity: dict):
    base = load_cluster("cpu-2core")
    return dataclasses.replace(base, notes={**base.notes, "cpu_identity": identity})


def test_another_cpu_is_re_measured_per_precision(monkeypatch):
    here = {"vendor": "AuthenticAMD", "family": 25, "flags": ["avx2", "f16c", "fma"]}
    monkeypatch.setattr(precision_probe, "cpu_identity", lambda: here)
    same = _cluster_calibrated_on(here)
    assert precision_probe.check_calibration(same, ("fp32", "bf16")) == (same, None)

    other = _cluster_calibrated_on({**here, "flags": ["avx2", "avx512_bf16", "avx512f", "f16c", "fma"]})
    then = other.notes["block_points"]
    slower = {"fp32": 1.25, "bf16": 20.0}  # seconds now / seconds calibrated on the compute-bound block

    def fake_block(batch, seq, d, heads, precision, repeats=1):
        seconds, flops = then[precision][-1]
        return seconds * slower[precision], flops

    monkeypatch.setattr(precision_probe, "block_seconds", fake_block)
    probed, line = precision_probe.check_calibration(other, ("fp32", "bf16"))
    assert "no avx512_bf16 avx512f here" in line and "bf16 x0.05" in line
    assert probed.device.flops["bf16"] == pytest.approx(other.device.flops["bf16"] / 20)
    assert probed.device.flops["fp32"] == pytest.approx(other.device.flops["fp32"] / 1.25)
    assert probed.device.flops["fp16"] == other.device.flops["fp16"]  # not planned for, not measured

    no_points = dataclasses.replace(other, notes={k: v for k, v in other.notes.items() if k != "block_points"})
    with pytest.raises(ValueError, match="cannot predict on this CPU"):
        precision_probe.check_calibration(no_points, ("bf16",))


def test_auto_on_another_cpu_plans_in_fp32_unless_told(monkeypatch):
    """Every rank plans on its own, so --auto does not probe: it leaves the precisions it cannot price."""
    monkeypatch.setattr(precision_probe, "cpu_identity", lambda: {"vendor": "GenuineIntel", "flags": ["avx2"]})
    argv = ["--auto", "--model", "tiny"]
    cfg, best, notes = auto.auto_config(build_parser().parse_args(argv), argv, world=4)
    assert cfg.plan.precision == "fp32" and "fp32 only" in notes[0] and "calibrated on" in notes[0]
    argv = ["--auto", "--model", "tiny", "--precision", "bf16"]
    cfg, _, notes = auto.auto_config(build_parser().parse_args(argv), argv, world=4)
    assert cfg.plan.precision == "bf16" and notes[0].startswith("warning:")
