"""Which CPU this is, in the terms that decide how fast each precision runs on it.

A calibration (``run.py calibrate``) measures one machine; machines of "the same kind" differ by CPU
generation, and with it by the vector instructions each precision's matrix products use: with AVX-512
BF16 bf16 runs about twice as fast as fp32, without it (AVX2 only) tens of times slower. So a calibration
records the identity of its CPU, and the planner compares it with the CPU it runs on before pricing with it
(compiler/planner/precision_probe.py).
"""

from __future__ import annotations

import platform
from pathlib import Path

# /proc/cpuinfo flags that change a precision's matmul speed: fp32 (AVX2 / FMA / AVX-512), bf16 (AVX-512
# BF16, AMX), fp16 (F16C conversions, AVX-512 FP16, AMX FP16).
PRECISION_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")


def cpu_identity(cpuinfo: str | Path = "/proc/cpuinfo") -> dict:
    """{"vendor", "family", "model", "model_name", "flags"} of the first processor in ``cpuinfo`` (Linux),
    or {"machine": ...} where there is no such file."""
    path = Path(cpuinfo)
    if not path.exists():
        return {"machine": platform.machine(), "processor": platform.processor()}
    fields: dict[str, str] = {}
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block is enough
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    identity = {"vendor": fields.get("vendor_id", ""), "model_name": fields.get("model name", ""),
                "flags": sorted(f for f in PRECISION_FLAGS if f in flags)}
    for key, name in (("family", "cpu family"), ("model", "model")):
        if fields.get(name, "").isdigit():
            identity[key] = int(fields[name])
    return identity


def describe(identity: dict) -> str:
    if "vendor" not in identity:
        return f"{identity.get('processor') or identity.get('machine', 'unknown CPU')}"
    family = f", family {identity['family']} model {identity['model']}" if "family" in identity and "model" in identity \
        else f", family {identity['family']}" if "family" in identity else ""
    return f"{identity.get('model_name') or identity['vendor']}{family} ({' '.join(identity['flags']) or 'no vector flags'})"


def identity_difference(recorded: dict, current: dict) -> str | None:
    """How ``current`` differs from ``recorded`` in what the recorded identity states, or None when they
    agree on all of it. Keys the recording lacks are not compared (a preset may record only its flags)."""
    differences = []
    for key in ("vendor", "model_name", "family", "model", "machine", "processor"):
        if key in recorded and recorded[key] != current.get(key):
            differences.append(f"{key.replace('_', ' ')} {current.get(key)!r} here, {recorded[key]!r} calibrated")
    if "flags" in recorded:
        missing = sorted(set(recorded["flags"]) - set(current.get("flags", [])))
        extra = sorted(set(current.get("flags", [])) - set(recorded["flags"]))
        if missing:
            differences.append(f"no {' '.join(missing)} here")
        if extra:
            differences.append(f"{' '.join(extra)} here but not calibrated")
    return "; ".join(differences) or None
