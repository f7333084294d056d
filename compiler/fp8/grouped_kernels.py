"""The experts' forward product on ``torch._scaled_grouped_mm`` (through compiler/torch_compat.py) where it runs the
recipe: CUDA builds that have it, rowwise scaling (its only float32-scaled form: scales (M,) and (E, N)), bf16
output, e4m3 operands, every expert's rows a multiple of 16 (torchao's and torchtitan's token-group alignment
for FP8 grouped GEMMs). Elsewhere ``None``, and grouped.py loops over the experts.

Rowwise quantization is per row, so quantizing all of x at once, and all experts' weight rows at once, gives the
bytes and scales the per-expert loop gives: the two paths differ only in accumulation order. As in kernels.py the
kernel is used only after a probe ran it once on this device and it agreed with the per-expert emulation.
Rows past offsets[-1] are zeroed (the grouped kernels leave them unwritten; compiler/torch_compat.py notes the
same of ``torch._grouped_mm`` on an H100).
"""

from __future__ import annotations

import torch

from compiler import torch_compat
from compiler.fp8.guard import AmaxGuard
from compiler.fp8.recipe import Recipe, emulated_matmul
from compiler.fp8.tensor import INPUT_FORWARD, WEIGHT_FORWARD

GROUP_ALIGNMENT = 16
_PROBED: dict[str, bool] = {}


def scaled_grouped_forward(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, *, groups: list[tuple[int, int, int]],
                           recipe: Recipe, out_dtype: torch.dtype, guard: AmaxGuard | None = None) -> torch.Tensor | None:
    """x (M, K), w (E, N, K), offsets (E,) int32, ``groups`` (expert, start, end) -> (M, N), or None."""
    if not (x.is_cuda and recipe.kernel == "rowwise" and out_dtype == torch.bfloat16 and torch_compat.has_scaled_grouped_mm()
            and x.shape[1] % 16 == 0 and w.shape[1] % 16 == 0
            and all((end - start) % GROUP_ALIGNMENT == 0 for _, start, end in groups)):
        return None
    key = str(x.device)
    if key not in _PROBED:
        _PROBED[key] = _probe(x.device, recipe)
    return _product(x, w, offsets, recipe, guard) if _PROBED[key] else None


def _product(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, recipe: Recipe,
             guard: AmaxGuard | None) -> torch.Tensor:
    (experts, n, k), m = w.shape, x.shape[0]
    x_q = recipe.quantize(x, INPUT_FORWARD, guard=guard)  # per row: (M, K), scales (M, 1)
    w_q = recipe.quantize(w.reshape(experts * n, k), WEIGHT_FORWARD, guard=guard)  # per weight row: (E N, K), (E N, 1)
    right = w_q.data.view(experts, n, k).transpose(-2, -1)  # (E, K, N), each expert's matrix column-major
    out = torch_compat.scaled_grouped_mm(x_q.data, right, x_q.scale.reshape(m), w_q.scale.reshape(experts, n), offsets,
                                         out_dtype=torch.bfloat16)
    rows = torch.arange(1, m + 1, device=x.device)
    return out.masked_fill((rows > offsets[-1]).unsqueeze(-1), 0)


def _probe(device: torch.device, recipe: Recipe) -> bool:
    """Two experts of 16 and 32 rows, one without; agreement with the per-expert emulation within 1/64."""
    generator = torch.Generator().manual_seed(0)
    with torch_compat.real_tensors(), torch.no_grad():
        x = (torch.randn(48, 64, generator=generator) * torch.rand(48, 1, generator=generator)).to(device)
        w = (torch.randn(3, 32, 64, generator=generator) * torch.rand(3, 32, 1, generator=generator)).to(device)
        offsets = torch.tensor([16, 16, 48], dtype=torch.int32, device=device)
        try:
            out = _product(x, w, offsets, recipe, None)
        except (RuntimeError, ValueError, NotImplementedError, TypeError):
            return False
        expected = torch.zeros(48, 32, device=device)
        for e, start, end in ((0, 0, 16), (2, 16, 48)):
            a = recipe.quantize(x[start:end], INPUT_FORWARD)
            b = recipe.quantize(w[e], WEIGHT_FORWARD).t()
            expected[start:end] = emulated_matmul(a, b, torch.float32)
        return out.dtype == torch.bfloat16 and bool(((out.float() - expected).abs() <= expected.abs().max() / 64).all())
