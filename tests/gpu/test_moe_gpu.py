"""The mixture of experts on a CUDA device (``pytest -m gpu``; skipped where torch finds none, tests/conftest.py):
torch's grouped GEMM, registered as the CUDA kernel of the experts' grouped product when
models/common/grouped_mm.py is imported, computes the loop's products and gradients; an MoE block in bf16
autocast agrees with fp32; the transformers fixtures' loss and greedy ids hold on the GPU."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from models import MoE, generate
from models.common.grouped_mm import grouped_gemm_applies, grouped_mm
from models.common.router import Routing
from runtime.checkpoint.hf_weights import check_weights, read_hf_model, read_state_dict
from runtime.commands.generate import build
from tests.paths import FIXTURE_ROOT

pytestmark = [pytest.mark.gpu]

FIXTURES = FIXTURE_ROOT / "hf-models"


@pytest.fixture(autouse=True)
def _exact_fp32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 products in fp32, for comparisons with the CPU
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def test_the_grouped_gemm_kernel_computes_the_loops_products_and_gradients():
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([37, 0, 64, 5, 100, 1, 0, 49])  # empty experts; 8 padding rows after the 256
    x, w, grad = torch.randn(264, 128, generator=g), torch.randn(8, 96, 128, generator=g), torch.randn(264, 96, generator=g)
    xb, wb = (t.to("cuda", torch.bfloat16).requires_grad_() for t in (x, w))
    offsets = counts.cumsum(0, dtype=torch.int32)
    fast = grouped_gemm_applies(xb, wb, 128, 96)
    assert fast == (torch.cuda.get_device_capability() >= (9, 0))
    out = grouped_mm(xb, wb, offsets.cuda())
    gx, gw = torch.autograd.grad(out, (xb, wb), grad.to("cuda", torch.bfloat16))
    # The reference: the loop in fp64 on the same bf16-rounded inputs.
    xr, wr = (t.detach().cpu().double().requires_grad_() for t in (xb, wb))
    want = grouped_mm(xr, wr, offsets)  # on the CPU: the loop
    want_x, want_w = torch.autograd.grad(want, (xr, wr), grad.to(torch.bfloat16).double())
    for got, ref in ((out, want), (gx, want_x), (gw, want_w)):
        torch.testing.assert_close(got.float().cpu(), ref.float(), rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    assert out[256:].eq(0).all()  # padding rows are zeros, as the loop's
    assert gw[1].eq(0).all() and gw[6].eq(0).all()  # experts without rows get no gradient


def test_an_moe_block_in_bf16_autocast_agrees_with_fp32_and_the_cpu():
    torch.manual_seed(0)
    moe = MoE(d_model=128, expert_width=96, n_experts=8, routing=Routing(top_k=2, norm_topk_prob=True),
              shared_width=64, aux_loss_coef=0.01)
    x = torch.randn(4, 64, 128)
    moe.eval()  # compare outputs without counting loads (the counts would stay on the CPU)
    with torch.no_grad():
        moe.router.gate.weight.mul_(20)  # well-separated scores: bf16 experts cannot flip a choice
        on_cpu = moe(x)
        moe.cuda()
        fp32 = moe(x.cuda())
        with torch.autocast("cuda", dtype=torch.bfloat16):
            bf16 = moe(x.cuda())
    torch.testing.assert_close(fp32.cpu(), on_cpu, rtol=1e-4, atol=1e-5)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), fp32, rtol=5e-2, atol=5e-2 * fp32.abs().max().item())
    moe.train()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        moe(x.cuda().requires_grad_()).float().square().sum().backward()  # the aux loss's backward too
    assert moe.take_tokens_per_expert().sum() == 4 * 64 * 2
    assert all(p.grad is not None and p.grad.isfinite().all() for p in moe.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", ["qwen3", "qwen3-moe", "mixtral"])
def test_the_transformers_fixtures_hold_on_the_gpu(name):
    expected = json.loads((FIXTURES / name / "expected.json").read_text())
    hf = read_hf_model(FIXTURES / name)
    model = build(hf.config, read_state_dict(check_weights(hf), hf.config)).cuda()
    batch = torch.tensor(expected["batch"], device="cuda")
    with torch.no_grad():
        logits = model(batch)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten()).item()
    assert loss == pytest.approx(expected["loss"], abs=1e-4)
    prompt = torch.tensor([expected["prompt"]], device="cuda")
    new = generate(model, prompt, n_layers=hf.config.n_layers, max_new_tokens=len(expected["greedy_new_ids"]))
    assert new[0].tolist() == expected["greedy_new_ids"]
