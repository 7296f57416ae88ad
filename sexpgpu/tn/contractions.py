"""The site contractions of the sweep, each a chain of reshapes and BLAS products.

Every contraction is written as a sequence of pairwise products (`pair`), each
one reshape + ``xp.dot`` (one GEMM), or ``xp.matmul`` over the sketch index when
that index is shared (the Khatri-Rao sketch). ``xp`` is the array backend
(`sexpgpu.tn.backend`: NumPy, or PyTorch on a GPU), so one set of contractions
serves every device. Labels name the legs::

    layer i (padded core)      l_i ── G_i ── r_i        x_0 = u of the result
                                       │                x_k = d of the result
                                    x_i above, x_{i+1} below

    environment C_j   (s, l_0 .. l_{k-1})   sketch of sites 0 .. j-1
    projected S       (e, r_0 .. r_{k-1})   sites j+1 .. n-1 against the output
    test tensor       (s, x_0, x_k)

Orders: the left environment meets the wide layers by plain GEMMs, and the
test tensor is first folded into a thin end layer (an MPO of small bond) when
there is one, so that the shared sketch index only ever meets small tensors;
the right-hand chain runs top-down or bottom-up, whichever needs fewer
multiply-adds. On the host, a site of two layers ends in products batched over
the rows of ``S`` that write ``Z`` where it belongs (`_top_last`,
`_bottom_last`), rather than a GEMM between two rearranging copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from math import prod

from .backend import Array, Backend

__all__ = [
    "arrange",
    "core_labels",
    "env_peak_per_column",
    "env_step",
    "environment_labels",
    "pair",
    "right_block",
    "right_columns",
]

Labels = tuple[str, ...]


@lru_cache(maxsize=64)
def core_labels(i: int) -> Labels:
    """Labels of layer ``i``'s padded core ``(l, r, u, d)``."""
    return (f"l{i}", f"r{i}", f"x{i}", f"x{i + 1}")


@lru_cache(maxsize=256)
def environment_labels(k: int, head: str, side: str) -> Labels:
    """Labels ``(head, side0, ..., side{k-1})`` of an environment of ``k`` layers."""
    return (head, *(f"{side}{i}" for i in range(k)))


@dataclass(frozen=True)
class _Recipe:
    """How `pair` multiplies two operands of given labels and shapes: permutations and shapes."""

    perm_a: tuple[int, ...]
    shape_a: tuple[int, ...]
    perm_b: tuple[int, ...]
    shape_b: tuple[int, ...]
    shape_out: tuple[int, ...]
    out: Labels


@lru_cache(maxsize=4096)
def _recipe(
    la: Labels,
    sa: tuple[int, ...],
    lb: Labels,
    sb: tuple[int, ...],
    batch: Labels,
    free_b: Labels | None,
) -> _Recipe:
    """`pair`'s plan, a pure function of labels and shapes (a sweep repeats a few of them)."""
    shared = [x for x in la if x in lb and x not in batch]
    # The contracted legs follow the bigger operand's layout, so that one is not copied.
    contract = [x for x in (la if prod(sa) >= prod(sb) else lb) if x in shared]
    free_a = [x for x in la if x not in lb]
    if free_b is None:
        free_b = tuple(x for x in lb if x not in la)
    dims = dict(zip(la, sa, strict=True)) | dict(zip(lb, sb, strict=True))
    out = (*batch, *free_a, *free_b)
    size = lambda group: prod(dims[x] for x in group)  # noqa: E731
    # Without a batch the leading size is dropped: a plain matrix product.
    lead = (size(batch),) if batch else ()
    return _Recipe(
        tuple(la.index(x) for x in (*batch, *free_a, *contract)),
        (*lead, size(free_a), size(contract)),
        tuple(lb.index(x) for x in (*batch, *contract, *free_b)),
        (*lead, size(contract), size(free_b)),
        tuple(dims[x] for x in out),
        out,
    )


def pair(
    xp: Backend,
    a: Array,
    la: Labels,
    b: Array,
    lb: Labels,
    batch: Labels = (),
    free_b: Labels | None = None,
    scratch: str | None = None,
) -> tuple[Array, Labels]:
    """Contract every label ``a`` and ``b`` share, except ``batch``, with one product.

    Each operand is viewed as a matrix (a stack of them with ``batch``): the
    library copies only when the axes of a group cannot merge; a transposed
    matrix stays a view, which BLAS takes as it is.

    Parameters
    ----------
    xp : Backend
        The array backend.
    a, b : array
        The operands.
    la, lb : tuple of str
        Their labels, one per axis.
    batch : tuple of str
        Shared labels kept as a batch axis (``np.matmul``), first in the result.
    free_b : tuple of str, optional
        The order of ``b``'s free labels in the result (default: ``b``'s), so
        that the next product can read the result without a copy.
    scratch : str, optional
        A reusable buffer for a result that is dead before the next product
        of that name (`Backend.dot`).

    Returns
    -------
    result : array
        Axes ``batch + free(a) + free(b)``, each group in its operand's order.
    labels : tuple of str
        The result's labels.
    """
    r = _recipe(la, tuple(a.shape), lb, tuple(b.shape), batch, free_b)
    am = xp.permute(a, r.perm_a).reshape(r.shape_a)
    bm = xp.permute(b, r.perm_b).reshape(r.shape_b)
    result = xp.matmul(am, bm, scratch) if batch else xp.dot(am, bm, scratch)
    return result.reshape(r.shape_out), r.out


def arrange(xp: Backend, x: Array, labels: Labels, order: Labels) -> Array:
    """Return ``x`` with its axes in ``order``, C-contiguous."""
    if labels == order:
        return xp.contiguous(x)
    return xp.contiguous(xp.permute(x, [labels.index(a) for a in order]))


def env_step(xp: Backend, env: Array, omega: Array, cores: Sequence[Array]) -> Array:
    """Advance a batch of sketch columns of the left environment by one site.

    ::

        C_j (s, l..) ──G_0──G_1── ... ──G_{k-1}──  ->  C_{j+1} (s, r..)
                        │x_0               │x_k
                        └──── omega (s, x_0, x_k) ┘   (s shared: Khatri-Rao)

    Parameters
    ----------
    xp : Backend
        The array backend.
    env : array
        Columns of ``C_j``, shape ``(b, l_0, ..., l_{k-1})``.
    omega : array
        The same columns of the site's test tensor, ``(b, u, d)``.
    cores : sequence of array
        The padded cores of the site, one per layer.

    Returns
    -------
    array
        Columns of ``C_{j+1}``, shape ``(b, r_0, ..., r_{k-1})``.
    """
    k = len(cores)
    if k > 1:
        # Fold the test tensor into a thin end layer (an MPO of small bond) when
        # that is smaller than a column of the environment, or clearly cheaper.
        way = _env_way(tuple(env.shape), tuple(omega.shape), tuple(tuple(c.shape) for c in cores))
        if way != "chain":
            fold = _env_step_thin_top if way == "top" else _env_step_thin_bottom
            return fold(xp, env, omega, cores)
    x, lx = env, environment_labels(k, "s", "l")
    down = f"x{k}"
    # A trivial lower leg (an MPS last) is left to the end; otherwise the test
    # tensor meets it right after the last layer, which shrinks the rest by d.
    early = k > 1 and omega.shape[2] > 1
    for i in reversed(range(k)):
        x, lx = pair(xp, x, lx, cores[i], core_labels(i))
        if i == k - 1 and early:
            x, lx = pair(xp, x, lx, omega, ("s", "x0", down), batch=("s",))
    if not early:
        x, lx = pair(xp, x, lx, omega, ("s", "x0", down), batch=("s",))
    return arrange(xp, x, lx, environment_labels(k, "s", "r"))


def _product_cost(
    a: dict[str, int], b: dict[str, int], batch: tuple[str, ...] = ()
) -> tuple[int, dict[str, int]]:
    """Multiply-adds of `pair` on operands of these legs, and the result's legs."""
    dims = a | b
    kept = {x: n for x, n in dims.items() if x in batch or not (x in a and x in b)}
    return prod(dims.values()), kept


@lru_cache(maxsize=1024)
def _env_way(
    env: tuple[int, ...], omega: tuple[int, ...], shapes: tuple[tuple[int, ...], ...]
) -> str:
    """How `env_step` goes at these shapes: ``"chain"``, ``"top"`` or ``"bottom"``.

    The test tensor is folded into the top layer (`_env_step_thin_top`) or
    the bottom one (`_env_step_thin_bottom`) where that end of the site (a
    column of the folded layer) is smaller than a column of the environment,
    the narrower end; else where a fold makes at most 3/4 of the plain
    chain's multiply-adds (the chain's batched product with the test tensor
    has an inner dimension of one physical leg, the folds' one of a bond, so
    close counts go to the fold less often than not). Near the left end of
    two Trotter steps on an MPS of bond 64 that folds sites whose ends are as
    wide as or wider than a column: 0.4 to 0.6 of the chain's multiply-adds,
    0.45 of its time. Every cost is proportional to the sketch columns, so
    every row tile agrees.
    """
    k = len(shapes)
    up, down = omega[1:]
    top = prod(shapes[0][:2]) * shapes[0][3] * down
    bottom = prod(shapes[-1][:3]) * up
    if min(top, bottom) < prod(env[1:]):
        return "top" if top <= bottom else "bottom"
    cores = [dict(zip(core_labels(i), shape, strict=True)) for i, shape in enumerate(shapes)]
    start = dict(zip(environment_labels(k, "s", "l"), env, strict=True))
    test = dict(zip(("s", "x0", f"x{k}"), omega, strict=True))
    early = omega[2] > 1

    def chain() -> int:
        total, x = 0, start
        for i in reversed(range(k)):
            cost, x = _product_cost(x, cores[i])
            total += cost
            if i == k - 1 and early:
                cost, x = _product_cost(x, test, ("s",))
                total += cost
        return total + (0 if early else _product_cost(x, test, ("s",))[0])

    def folded(thin: int) -> int:
        total, w = _product_cost(test, cores[thin])
        if thin == 0:
            cost, x = _product_cost(w, start, ("s",))
            total += cost
            rest = range(1, k)
        else:
            x, rest = start, range(k - 1)
        for i in rest:
            cost, x = _product_cost(x, cores[i])
            total += cost
        return total + (0 if thin == 0 else _product_cost(x, w, ("s",))[0])

    fold = min(("top", folded(0)), ("bottom", folded(k - 1)), key=lambda way: way[1])
    return fold[0] if 4 * fold[1] <= 3 * chain() else "chain"


def _env_step_thin_top(xp: Backend, env: Array, omega: Array, cores: Sequence[Array]) -> Array:
    """`env_step` when the top layer is thin (an MPO of small bond over a wide MPS).

    ::

        W = omega . G_0 over x_0         (s, x_k, l_0, r_0, x_1)    small
        W . C_j over l_0, s shared        (s, x_k, r_0, x_1, l_1..)
        then G_1 .. G_{k-1}, each one GEMM over (l_i, x_i[, x_k])

    W stands first so that the product lays out ``(s, x_k, r_0 | x_1, l_1)``:
    with a ket last (``x_k`` of size 1) the next GEMM reads it without a copy.
    """
    k = len(cores)
    w, lw = pair(xp, omega, ("s", "x0", f"x{k}"), cores[0], core_labels(0))
    x, lx = pair(xp, w, lw, env, environment_labels(k, "s", "l"), batch=("s",), scratch="env")
    for i in range(1, k):
        x, lx = pair(xp, x, lx, cores[i], core_labels(i))
    return arrange(xp, x, lx, environment_labels(k, "s", "r"))


def _env_step_thin_bottom(xp: Backend, env: Array, omega: Array, cores: Sequence[Array]) -> Array:
    """`env_step` when the bottom layer is thin (a wide MPO times a thin one).

    ::

        W = omega . G_{k-1} over x_k       (s, x_0, l_{k-1}, r_{k-1}, x_{k-1})   small
        C_j . G_0 .. G_{k-2}, each one GEMM over (l_i[, x_i])
        then . W over (l_{k-1}, x_0, x_{k-1}), s shared

    On the host a two-layer site returns ``C_{j+1}`` as a view laid out ``(s,
    r_1, r_0)``, the thin leg first: the next site's first product then reads
    it as ``(s r_1, r_0)`` in place, and the right-to-left pass's `_bottom_last`
    makes ``Z`` with its left legs in that order (`right_columns`).
    """
    k = len(cores)
    if k == 2 and xp.is_host:
        w, lw = pair(xp, omega, ("s", "x0", "x2"), cores[1], core_labels(1))
        free = ("x0", "x1", "r0")  # r_0 last: the fold reads x as (s, l_1 x_0 x_1, r_0) in place
        x, lx = pair(
            xp, env, ("s", "l0", "l1"), cores[0], core_labels(0), free_b=free, scratch="env"
        )
        x, lx = pair(xp, w, lw, x, lx, batch=("s",))  # (s, r1, r0)
        return xp.permute(x, [lx.index(a) for a in ("s", "r0", "r1")])
    w, lw = pair(xp, omega, ("s", "x0", f"x{k}"), cores[-1], core_labels(k - 1))
    x, lx = env, environment_labels(k, "s", "l")
    for i in range(k - 1):
        free = tuple(a for a in core_labels(i) if a not in lx)
        if i == k - 2:  # r_i last: the fold below then reads x as a transposed view
            free = (*(a for a in free if a != f"r{i}"), f"r{i}")
        scratch = "env" if i == 0 else None  # the first is read once, by the next product
        x, lx = pair(xp, x, lx, cores[i], core_labels(i), free_b=free, scratch=scratch)
    x, lx = pair(xp, x, lx, w, lw, batch=("s",))
    return arrange(xp, x, lx, environment_labels(k, "s", "r"))


def _chain_cost(
    start: dict[str, int], shapes: Sequence[tuple[int, ...]], order: Sequence[int]
) -> int:
    """Multiply-adds of contracting ``start`` with the cores (of ``shapes``) in ``order``."""
    dims, cost = dict(start), 0
    for i in order:
        core = dict(zip(core_labels(i), shapes[i], strict=True))
        cost += prod(dims.values()) * prod(n for a, n in core.items() if a not in dims)
        for a in core:
            if a in dims:
                del dims[a]
            else:
                dims[a] = core[a]
    return cost


@lru_cache(maxsize=1024)
def _right_order(proj: tuple[int, ...], shapes: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    """Bottom-up or top-down, whichever needs fewer multiply-adds (a pure function of shapes)."""
    k = len(shapes)
    start = dict(zip(environment_labels(k, "e", "r"), proj, strict=True))
    orders = [tuple(reversed(range(k))), tuple(range(k))]
    return min(orders, key=lambda order: _chain_cost(start, shapes, order))


def right_columns(xp: Backend, proj: Array, cores: Sequence[Array]) -> tuple[int, ...]:
    """The order of ``Z``'s left legs that `right_block` makes without a copy.

    ``(0, 1, ..)`` but where the host's two-layer site ends in the bottom
    layer (`_bottom_last`): there ``(1, 0)``, ``l_1`` before ``l_0``, lets the
    thin product run as one product per row of ``S`` and upper leg, each
    ``(x_2 l_1, r_1 x_1) @ (r_1 x_1, l_0)``, rather than one per pair of
    physical legs with ``l_1`` columns (a bulk site of a bond-100 MPO times a
    bond-4 one: 0.42 against 0.74 ms). The left-to-right pass keeps such
    environments laid out ``(s, r_1, r_0)`` (`_env_step_thin_bottom`), so
    ``C_j``'s columns match without a copy. A pure function of the shapes, so
    every row tile of a site agrees.
    """
    k = len(cores)
    if k == 2 and xp.is_host:
        *_first, last = _right_order(tuple(proj.shape), tuple(tuple(c.shape) for c in cores))
        if last == 1 and not _kernel_takes(xp, cores, last):
            return (1, 0)
    return tuple(range(k))


def right_block(
    xp: Backend, proj: Array, cores: Sequence[Array], columns: Sequence[int] | None = None
) -> Array:
    """Contract the projected environment with a site's cores.

    ::

        ──G_0──G_1── ... ──G_{k-1}── S (e, r..)   ->   Z (e, u, d, l_0 .. l_{k-1})
          │x_0               │x_k

    ``Z`` serves the site twice: the sketch is ``Z C_j^T`` and the next
    projected environment ``conj(core) Z``, so it is computed once.

    Parameters
    ----------
    xp : Backend
        The array backend.
    proj : array
        ``S``, shape ``(e, r_0, ..., r_{k-1})``.
    cores : sequence of array
        The padded cores of the site.
    columns : sequence of int, optional
        The order of the left legs in ``Z`` (default ``0, 1, ..``);
        `right_columns` tells the order made without a copy.

    Returns
    -------
    array
        ``Z``, shape ``(e, u, d, l_{columns[0]}, ..)``, C-contiguous.
    """
    k = len(cores)
    z, lz = proj, environment_labels(k, "e", "r")
    order = tuple(range(k)) if columns is None else tuple(columns)
    final = ("e", "x0", f"x{k}", *(f"l{i}" for i in order))
    *first, last = _right_order(tuple(proj.shape), tuple(tuple(c.shape) for c in cores))
    if k == 2 and xp.is_host and not _kernel_takes(xp, cores, last):
        # Batched products over Z's rows leave Z in place: no rearranging copies,
        # which on the host cost as much as the thin layer's product itself.
        return (_top_last if last == 0 else _bottom_last)(xp, proj, cores, final)
    for i in first:
        z, lz = pair(xp, z, lz, cores[i], core_labels(i))
    if k == 2:  # a wide layer and maybe a thin one: the last product in one pass
        done = _thin_last(xp, z, lz, cores[last], last, final)
        if done is not None:
            return done
    z, lz = pair(xp, z, lz, cores[last], core_labels(last))
    return arrange(xp, z, lz, final)


def _kernel_takes(xp: Backend, cores: Sequence[Array], last: int) -> bool:
    """Whether `Backend.thin_product` takes a two-layer site's last product (see `_thin_last`)."""
    thin = cores[last].shape  # (l, r, x_inner, x_outer), the kernel's (M, R, Y, W)
    inner, outer = (3, 2) if last == 0 else (2, 3)
    other_outer = cores[1 - last].shape[3 if last == 0 else 2]
    return xp.has_thin_product(thin[1] * thin[inner], thin[0], max(thin[outer], other_outer))


def _top_last(xp: Backend, proj: Array, cores: Sequence[Array], final: Labels) -> Array:
    """`right_block` of two layers, the top one last, with no rearranging copy of ``Z``.

    ::

        W = S . G_1 over r_1, laid out   (e, r_0 x_1, x_2 l_1)     one GEMM
        Z[e] = G_0 (x_0 l_0, r_0 x_1) @ W[e]                       one product per row of S

    The second product reads ``W`` as it lies and writes ``Z`` as ``(e, x_0,
    l_0, x_2, l_1)``: the final layout when the lower leg is trivial (a ket
    last), else one rearranging copy, where the plain chain makes two.
    """
    top, bottom = cores
    w, _ = pair(
        xp, proj, ("e", "r0", "r1"), bottom, core_labels(1), free_b=("x1", "x2", "l1"), scratch="w"
    )
    e, r0, x1, x2, l1 = w.shape
    l0, x0 = top.shape[0], top.shape[2]
    g = xp.contiguous(xp.permute(top, (2, 0, 1, 3))).reshape(x0 * l0, r0 * x1)
    z = xp.matmul_broadcast(g, w.reshape(e, r0 * x1, x2 * l1))  # (e, x0 l0, x2 l1)
    return arrange(xp, z.reshape(e, x0, l0, x2, l1), ("e", "x0", "l0", "x2", "l1"), final)


def _bottom_last(xp: Backend, proj: Array, cores: Sequence[Array], final: Labels) -> Array:
    """`right_block` of two layers, the bottom one last, with no rearranging copy of ``Z``.

    ::

        W = S . G_0 over r_0, laid out        (e, r_1 x_1, x_0, l_0)     one GEMM
        Z[e, x_0, x_2] = W[e, :, x_0]^T (l_0, r_1 x_1) @ G_1[x_2] (r_1 x_1, l_1)

    The products, one per row of S and pair of physical legs, write ``Z`` in
    its final layout ``(e, x_0, x_2, l_0, l_1)``. Where ``final`` puts ``l_1``
    before ``l_0`` (`right_columns`), one product per row of S and ``x_0``::

        Z[e, x_0] (x_2 l_1, l_0) = G_1 (x_2 l_1, r_1 x_1) @ W[e, :, x_0] (r_1 x_1, l_0)
    """
    top, bottom = cores
    w, _ = pair(
        xp, proj, ("e", "r0", "r1"), top, core_labels(0), free_b=("x1", "x0", "l0"), scratch="w"
    )
    e, r1, x1, x0, l0 = w.shape
    l1, x2 = bottom.shape[0], bottom.shape[3]
    if final[3:] == ("l1", "l0"):
        # Z[e, x_0] = G_1 (x_2 l_1, r_1 x_1) @ W[e, :, x_0] (r_1 x_1, l_0), W read in place
        g = xp.contiguous(xp.permute(bottom, (3, 0, 1, 2))).reshape(x2 * l1, r1 * x1)
        w = xp.permute(w.reshape(e, r1 * x1, x0, l0), (0, 2, 1, 3))  # (e, x0, r1 x1, l0)
        z = xp.matmul_broadcast(g, w)  # (e, x0, x2 l1, l0)
        return arrange(xp, z.reshape(e, x0, x2, l1, l0), ("e", "x0", "x2", "l1", "l0"), final)
    g = xp.contiguous(xp.permute(bottom, (3, 1, 2, 0))).reshape(x2, r1 * x1, l1)
    w = xp.permute(w.reshape(e, r1 * x1, x0, l0), (0, 2, 3, 1)).reshape(e, x0, 1, l0, r1 * x1)
    z = xp.matmul_broadcast(w, g)  # (e, x0, x2, l0, l1)
    return arrange(xp, z, ("e", "x0", "x2", "l0", "l1"), final)


def _thin_last(
    xp: Backend, z: Array, lz: Labels, core: Array, i: int, final: Labels
) -> Array | None:
    """A two-layer site's last product, with layer ``i``, by `Backend.thin_product`.

    Its contraction is ``r_i`` and the inner physical leg ``x1``; ``z``'s
    free legs are the other layer's ``l`` and the outer physical leg on its
    side. None where the backend has no routine for it.
    """
    other, outer, own = f"l{1 - i}", ("x2" if i == 0 else "x0"), ("x0" if i == 0 else "x2")
    order = ("e", f"r{i}", other, outer, "x1")  # (E, R, L, X, Y)
    if sorted(lz) != sorted(order):
        return None
    z5 = xp.permute(z, [lz.index(a) for a in order])
    g = xp.permute(core, [core_labels(i).index(a) for a in (f"l{i}", f"r{i}", "x1", own)])
    result_labels = ("e", outer, own, other, f"l{i}")  # (e, x, w, l, m)
    return xp.thin_product(z5, g, [result_labels.index(a) for a in final])


def env_peak_per_column(shapes: Sequence[tuple[int, int, int, int]]) -> int:
    """Estimate the elements `env_step` holds per sketch column (a generous bound)."""
    k = len(shapes)
    up, down = shapes[0][2], shapes[-1][3]
    peak = 0
    for i in range(k + 1):
        lefts = prod(s[0] for s in shapes[:i])
        rights = prod(s[1] for s in shapes[i:])
        mid = shapes[i][2] if i < k else down
        peak = max(peak, lefts * rights * up * down * mid)
    # an input, an output and a rearranged copy may be alive together
    return 3 * peak
