"""Small random trains and dense references for the sexpgpu.tn tests.

The references use only NumPy (einsum on dense arrays), never sexpgpu.tn.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

KINDS = {2: "mps", 3: "mpo"}

# Relative error a dtype's exact contraction may show.
EXACT_TOL = {
    np.float32: 2e-5,
    np.float64: 1e-12,
    np.complex64: 2e-5,
    np.complex128: 1e-12,
}


def _bonds(n: int, chi: int, phys: int) -> list[int]:
    """Bonds capped by the physical dimension toward each end, as quimb makes them."""
    return [min(chi, phys ** (j + 1), phys ** (n - 1 - j)) for j in range(n - 1)]


def _draw(rng: np.random.Generator, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    a = rng.standard_normal(shape)
    if np.dtype(dtype).kind == "c":
        a = a + 1j * rng.standard_normal(shape)
    return a.astype(dtype)


def random_mps(n, chi, rng, dtype=np.float64, phys=2, decay=0.0):
    """A random MPS in quimb's layout; ``decay`` makes its spectrum fall off."""
    bonds = _bonds(n, chi, phys)
    sites = []
    for j in range(n):
        left = [bonds[j - 1]] if j > 0 else []
        right = [bonds[j]] if j < n - 1 else []
        site = _draw(rng, (*left, *right, phys), dtype)
        if decay and right:
            axis = 0 if j == 0 else 1
            scale = np.exp(-decay * np.arange(right[0])).reshape(
                [-1 if a == axis else 1 for a in range(site.ndim)]
            )
            site = (site * scale).astype(dtype)
        sites.append(site / np.linalg.norm(site))
    return sites


def random_mpo(n, bond, rng, dtype=np.float64, phys=2):
    """A random MPO in quimb's layout, bulk ``(l, r, u, d)``."""
    sites = []
    for j in range(n):
        left = [bond] if j > 0 else []
        right = [bond] if j < n - 1 else []
        site = _draw(rng, (*left, *right, phys, phys), dtype)
        sites.append(site / np.linalg.norm(site) * phys)
    return sites


def dense(train):
    """A train as a dense vector (MPS) or matrix (MPO)."""
    kind = KINDS[np.ndim(train[0])]
    n = len(train)
    out = np.ones((1,) * (1 if kind == "mps" else 2) + (1,))  # (phys.., bond)
    for j, site in enumerate(train):
        site = np.asarray(site)
        if j == 0:
            site = site[None]
        if j == n - 1:
            site = site[:, None]
        if kind == "mps":  # out (P, b), site (b, r, p) -> (P, p, r)
            out = np.einsum("Pb,brp->Ppr", out, site).reshape(-1, site.shape[1])
        else:  # out (U, D, b), site (b, r, u, d) -> (U, u, D, d, r)
            new = np.einsum("UDb,brud->UuDdr", out, site)
            u_, uu, d_, dd, r = new.shape
            out = new.reshape(u_ * uu, d_ * dd, r)
    return out[..., 0]


def dense_stack(trains):
    """The product of a stack in mathematical order, as a dense array."""
    arrays = [dense(t) for t in trains]
    result = arrays[0]
    for a in arrays[1:]:
        result = result @ a
    return result


def ttsvd_error(target, n, chi, kind):
    """Relative error of sequential SVD truncation of a dense train to bond ``chi``."""
    if kind == "mps":
        phys = round(target.size ** (1 / n))
        tensor = target.reshape((phys,) * n)
    else:
        u = round(target.shape[0] ** (1 / n))
        d = round(target.shape[1] ** (1 / n))
        tensor = target.reshape((u,) * n + (d,) * n)
        order = [a for j in range(n) for a in (j, n + j)]
        tensor = tensor.transpose(order).reshape((u * d,) * n)
    rest = tensor.reshape(1, -1)
    approx_cores = []
    for _ in range(n - 1):
        b = rest.shape[0]
        m = rest.reshape(b * tensor.shape[0], -1)
        uu, s, vh = np.linalg.svd(m, full_matrices=False)
        r = min(chi, s.size)
        approx_cores.append(uu[:, :r])
        rest = s[:r, None] * vh[:r]
    # rebuild
    full = approx_cores[0]
    for c in approx_cores[1:]:
        full = (full @ c.reshape(full.shape[1], -1)).reshape(-1, c.shape[1])
    full = full @ rest
    flat = tensor.reshape(-1)
    return np.linalg.norm(full.reshape(-1) - flat) / np.linalg.norm(flat)


def rel_error(result, target):
    """Relative Frobenius error of a result train against a dense target."""
    got = dense(result)
    return np.linalg.norm(got - target) / np.linalg.norm(target)


def make_stack(shape, n, rng, dtype=np.float64, chi=6, bond=2, decay=0.0):
    """Build a stack from a string such as ``"OOS"`` (O: MPO, S: MPS)."""
    return [
        random_mps(n, chi, rng, dtype, decay=decay) if c == "S" else random_mpo(n, bond, rng, dtype)
        for c in shape
    ]


@contextmanager
def wrapped_seams(backend=None, inject=None):
    """Run tn's sweep on other arrays or under simulated allocation failures, for tests.

    The product has no switch for either: this wraps the seams instead.
    ``backend="torch"`` makes `backends_for` give the cpu ranks PyTorch's CPU
    device (the GPU code path); ``inject`` (a `FailureInjector`) is consulted
    by every piece `run_with_split` computes, with the piece's row count.
    """
    from sexpgpu.runtime.devices import Device
    from sexpgpu.tn import api, engine, sweep

    real_backends, real_split = api.backends_for, sweep.run_with_split

    def torch_on_cpu(fn, device, resources):
        made = real_backends(fn, device, resources)
        if device != "cpu":
            return made
        # engine's name, looked up now: a test may have wrapped it in turn
        return [engine.TorchBackend(Device("cpu", xp.device.index)) for xp in made]

    def failing(fn, batch, state, *args, **kw):
        def guarded(piece):
            inject.check(len(piece[0]) if isinstance(piece, tuple) else len(piece))
            return fn(piece)

        return real_split(guarded, batch, state, *args, **kw)

    if backend == "torch":
        api.backends_for = torch_on_cpu
    if inject is not None:
        sweep.run_with_split = failing
    try:
        yield
    finally:
        api.backends_for, sweep.run_with_split = real_backends, real_split


def run_src(
    stack,
    chi,
    *,
    seed,
    device="cpu",
    backend=None,
    inject=None,
    resources=None,
    cutoff=0.0,
    oversample=1.0,
    out=None,
):
    """`src` through its engine, on the arrays `backend` names and under `inject`'s failures."""
    from sexpgpu.tn.api import StackCall, StackOptions, run_stack

    names = [f"trains[{i}]" for i in range(len(stack))]
    call = StackCall(
        "src",
        stack,
        names,
        chi,
        StackOptions(cutoff, oversample, None, seed, device, resources, out),
    )
    with wrapped_seams(backend, inject):
        return run_stack(call)
