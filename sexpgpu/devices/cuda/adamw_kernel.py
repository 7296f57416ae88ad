"""The Triton kernel of `sexpgpu.devices.cuda.adamw` (loaded by `triton_support.kernel`)."""

import triton
import triton.language as tl

__all__ = ["adamw_kernel"]


@triton.jit
def adamw_kernel(
    rows_ptr, blocks_ptr, lr_ptr, step_ptr, scale_ptr, beta1, beta2, eps, wd,
    HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # One program: BLOCK elements of one parameter. `blocks` names the parameter
    # (4 bytes a program); its row of `rows` holds the addresses of the parameter,
    # its gradient and moments (f32, one layout), its first program, its size and
    # the address of its bf16 copy (0: none).
    pid = tl.program_id(0).to(tl.int64)
    row = rows_ptr + tl.load(blocks_ptr + pid).to(tl.int64) * 7
    p_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    at = (pid - tl.load(row + 4)) * BLOCK + tl.arange(0, BLOCK)
    mask = at < tl.load(row + 5)
    lr = tl.load(lr_ptr)
    t = tl.load(step_ptr)
    step_size = lr / (1 - tl.exp2(t * tl.log2(beta1)))  # lr / (1 - beta1^t)
    root_bc2 = tl.sqrt(1 - tl.exp2(t * tl.log2(beta2)))
    g = tl.load(g_ptr + at, mask=mask)
    if HAS_SCALE:
        g = g * tl.load(scale_ptr)
    p = tl.load(p_ptr + at, mask=mask)
    m = tl.load(m_ptr + at, mask=mask)
    v = tl.load(v_ptr + at, mask=mask)
    p = p * (1 - lr * wd)
    m = m + (g - m) * (1 - beta1)
    v = v * beta2 + (1 - beta2) * g * g
    p = p - step_size * (m / (tl.sqrt(v) / root_bc2 + eps))
    tl.store(p_ptr + at, p, mask=mask)
    tl.store(m_ptr + at, m, mask=mask)
    tl.store(v_ptr + at, v, mask=mask)
    copy = tl.load(row + 6)
    if copy != 0:
        tl.store(copy.to(tl.pointer_type(tl.bfloat16)) + at, p.to(tl.bfloat16), mask=mask)
