"""The cross-entropy kernel (`sexpgpu.devices.cuda.xent`) against the same arithmetic in torch.

Under Triton's interpreter on the CPU: Triton reads ``TRITON_INTERPRET``
when it is first imported, so the cases run in a pytest of their own with it
set (`test_the_kernel_under_the_interpreter`); in this process they skip.
On a GPU (``-m gpu``) the compiled kernel is checked at GPT-2's vocabulary.
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreted import interpreted_only, run_interpreted

from sexpgpu.devices.cuda import xent

pytest.importorskip("triton")
HAS_CUDA = torch.cuda.is_available()
# (rtol, atol) of the gradient: f32 exactly as torch but for exp's last bits;
# bf16 one rounding step of the result.
TOL = {torch.float32: (1e-5, 1e-7), torch.bfloat16: (8e-3, 1e-6)}


def test_the_kernel_under_the_interpreter():
    run_interpreted(__file__)


def _check(logits: torch.Tensor, ids: torch.Tensor, g: torch.Tensor, grad_dtype) -> None:
    want_loss, want_grad = xent._in_torch(logits, ids, g, grad_dtype)
    loss = torch.full(logits.shape[:1], float("nan"), device=logits.device)
    grad = torch.full(logits.shape, float("nan"), dtype=grad_dtype, device=logits.device)
    xent.launch(logits, ids, g, loss, grad)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    rtol, atol = TOL[grad_dtype]
    torch.testing.assert_close(grad.float(), want_grad.float(), rtol=rtol, atol=atol)
    alone = torch.full(logits.shape[:1], float("nan"), device=logits.device)
    xent.launch(logits, ids, g, alone, None)  # the loss alone: the first pass
    torch.testing.assert_close(alone, want_loss, rtol=1e-5, atol=1e-5)
    if grad_dtype == logits.dtype:  # the same kernel writing the gradient over its logits
        over = logits.clone()
        xent.launch(over, ids, g, loss, over)
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(over.float(), want_grad.float(), rtol=rtol, atol=atol)


@interpreted_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("vocab", [37, 100, 128], ids=lambda v: f"vocab{v}")
@pytest.mark.parametrize("weights", ["per-row", "broadcast"])
def test_loss_and_gradient_equal_torch(monkeypatch, dtype, vocab, weights):
    monkeypatch.setattr(xent, "BLOCK", 32)  # several loads a row, and a masked tail
    gen = torch.Generator().manual_seed(vocab)
    rows = 6
    wide = torch.randn(rows, vocab + 5, generator=gen) * 5
    logits = wide[:, 3 : 3 + vocab].to(dtype)
    if dtype == torch.float32:
        logits = wide[:, 3 : 3 + vocab]  # rows further apart than the vocabulary
    ids = torch.randint(0, vocab, (rows,), generator=gen, dtype=torch.int32)
    ids[0], ids[1] = 0, vocab - 1  # the first and the last class
    if weights == "broadcast":
        g = torch.full((1,), 1 / rows).expand(rows)  # a mean's: stride 0
    else:
        g = torch.randn(rows, generator=gen)
    _check(logits, ids, g, dtype)


@interpreted_only
def test_the_op_on_the_cpu_is_the_torch_arithmetic():
    # Outside the interpreter the op's CPU kernel is `_in_torch`; here both must agree.
    logits = torch.randn(4, 50)
    ids = torch.tensor([3, 0, 49, 7], dtype=torch.int32)
    g = torch.rand(4)
    loss, grad = torch.ops.sexpgpu.xent_with_grad(logits, ids, g, torch.float32)
    _check(logits, ids, g, torch.float32)
    want_loss, want_grad = xent._in_torch(logits, ids, g, torch.float32)
    torch.testing.assert_close((loss, grad), (want_loss, want_grad))
    over = logits.clone()
    loss = torch.ops.sexpgpu.xent_with_grad_over(over, ids, g)
    torch.testing.assert_close((loss, over), (want_loss, want_grad))
    torch.testing.assert_close(torch.ops.sexpgpu.xent_loss(logits, ids), want_loss)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_compiled_kernel_at_gpt2s_vocabulary(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, vocab = 64, 50304
    logits = (torch.randn(rows, vocab, generator=gen, device="cuda") * 4).to(dtype)
    ids = torch.randint(0, vocab, (rows,), generator=gen, device="cuda", dtype=torch.int32)
    g = torch.full((1,), 1 / rows, device="cuda").expand(rows)
    _check(logits, ids, g, dtype)
    loss, grad = torch.ops.sexpgpu.xent_with_grad(logits, ids, g, dtype)  # the op's GPU kernel
    want = xent._in_torch(logits, ids, g, dtype)
    torch.testing.assert_close(loss, want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.float(), want[1].float(), rtol=TOL[dtype][0], atol=1e-6)
    alone = torch.ops.sexpgpu.xent_loss(logits, ids)  # the loss alone
    torch.testing.assert_close(alone, want[0], rtol=1e-5, atol=1e-5)
    over = logits.clone()
    loss = torch.ops.sexpgpu.xent_with_grad_over(over, ids, g)  # written over its logits
    torch.testing.assert_close(loss, want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(over.float(), want[1].float(), rtol=TOL[dtype][0], atol=1e-6)
