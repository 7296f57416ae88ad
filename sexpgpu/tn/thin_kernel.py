"""The Triton kernel of `sexpgpu.tn.thin` (imported only where Triton is).

A module of its own, with ``triton.language`` among its globals: Triton's
interpreter (``TRITON_INTERPRET=1``, which CI runs it under) swaps the
language's functions there.
"""

import triton
import triton.language as tl

__all__ = ["thin_kernel"]


@triton.jit
def thin_kernel(
    z_ptr, g_ptr, out_ptr, L,
    sz_e, sz_r, sz_l, sz_x, sz_y,
    so_e, so_x, so_w, so_l, so_m,
    R: tl.constexpr, X: tl.constexpr, Y: tl.constexpr, W: tl.constexpr,
    M: tl.constexpr, K2: tl.constexpr, M2: tl.constexpr, BL: tl.constexpr,
    CPLX: tl.constexpr,
):  # fmt: skip
    # One program: one row e, BL values of l, every x, w and m. Strides
    # count elements; complex pointers are to their float pairs.
    C: tl.constexpr = 2 if CPLX else 1
    e = tl.program_id(0).to(tl.int64)
    li = tl.program_id(1) * BL + tl.arange(0, BL)
    k = tl.arange(0, K2)  # the contracted pair (r, y), padded to a power of two
    m = tl.arange(0, M2)
    lm, km, mm = li < L, k < R * Y, m < M
    r, y = k // Y, k % Y
    dt = z_ptr.dtype.element_ty
    for x in tl.static_range(X):
        at = e * sz_e + x * sz_x + li[:, None] * sz_l + (r * sz_r + y * sz_y)[None, :]
        zmask = lm[:, None] & km[None, :]
        zr = tl.load(z_ptr + C * at, mask=zmask, other=0.0)[:, :, None]  # (BL, K2, 1)
        if CPLX:
            zi = tl.load(z_ptr + C * at + 1, mask=zmask, other=0.0)[:, :, None]
        for w in tl.static_range(W):
            gat = ((m[None, :] * R + r[:, None]) * Y + y[:, None]) * W + w  # g (M, R, Y, W)
            gmask = km[:, None] & mm[None, :]
            gr = tl.load(g_ptr + C * gat, mask=gmask, other=0.0)[None, :, :]  # (1, K2, M2)
            ot = e * so_e + x * so_x + w * so_w + li[:, None] * so_l + m[None, :] * so_m
            omask = lm[:, None] & mm[None, :]
            if CPLX:
                gi = tl.load(g_ptr + C * gat + 1, mask=gmask, other=0.0)[None, :, :]
                re = tl.sum(zr * gr - zi * gi, axis=1)  # (BL, M2)
                im = tl.sum(zr * gi + zi * gr, axis=1)
                tl.store(out_ptr + C * ot + 1, im.to(dt), mask=omask)
            else:
                re = tl.sum(zr * gr, axis=1)
            tl.store(out_ptr + C * ot, re.to(dt), mask=omask)
