"""`src`, `apply` and `compress`: contraction and compression of tensor trains.

Successive randomized compression (SRC): Camaño, Epperly and Tropp,
"Successive randomized compression: a randomized algorithm for the compressed
MPO-MPS product", arXiv:2504.06475.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from . import gemm3m
from .args import (
    check_chi_out,
    check_cutoff,
    check_device,
    check_resources,
    check_seed,
    sketch_size,
)
from .engine import backends_for, execute
from .exact import exact_two_sites
from .interop import open_trains, quimb_kind
from .nodes import agree_on_call, node_config, open_nodes, problem_key
from .resources import Resources
from .sink import DatasetSink, check_out
from .sketch import SketchSource, sketch_dtype, work_dtype
from .trains import Stack, normalize_stack, unpad
from .trim import prepare

__all__ = ["StackCall", "StackOptions", "apply", "compress", "run_stack", "src"]

logger = logging.getLogger(__name__)

# The randomized sweep needs a site between the two boundary sites.
MIN_SWEEP_SITES = 3


@dataclass(frozen=True)
class StackOptions:
    """The keyword arguments `src`, `apply`, `compress` and `compress_network` share.

    As their caller wrote them, not yet checked (`run_stack` checks them).
    """

    cutoff: object
    oversample: object
    dtype: DTypeLike | None
    seed: object
    device: object
    resources: object
    out: object = None


@dataclass(frozen=True)
class StackCall:
    """One call of `src`, `apply`, `compress` or `compress_network`, as its caller wrote it.

    `fn` names the public function (for messages), `names` each train (in
    messages, ``trains[0]`` or ``left_tensor``); `chi_out` and `options` are
    the public arguments, not yet checked (`run_stack` checks them).
    """

    fn: str
    trains: Sequence[Any]
    names: Sequence[str]
    chi_out: object
    options: StackOptions


def run_stack(call: StackCall) -> Any:
    """Validate every argument of `call`, then run the exact path or the sweep.

    The engine behind `src`, `apply`, `compress` and `compress_network`.
    """
    fn, options = call.fn, call.options
    seed, out = options.seed, options.out
    chi = check_chi_out(fn, call.chi_out)
    cut = check_cutoff(fn, options.cutoff)
    size = sketch_size(fn, chi, options.oversample)
    check_seed(fn, seed)
    gemm3m.check_setting(fn)
    opened = open_trains(call.trains, fn, call.names)
    where = check_device(fn, options.device, opened.on_gpu)
    res = check_resources(fn, options.resources) or Resources()
    check_out(fn, out)
    backends = backends_for(fn, where, res)
    config = node_config(res, where, [xp.device.index for xp in backends])
    # Every node validates inside the link: one that fails leaves it, so the
    # others stop at once instead of waiting for it.
    with open_nodes(fn, config) as link:
        stack: Stack = normalize_stack(opened.trains, fn, call.names)
        # No cut has more rank than its bound, so wider sketches span nothing
        # more: chi_out=10**9 asks for no truncation, not for a 10**9-wide sketch.
        size = min(size, max(stack.cut_ranks, default=size))
        sketch = sketch_dtype(options.dtype, stack.dtype, fn)
        work = work_dtype(sketch, stack.dtype)
        # What every node must agree on; one node has no one to agree with.
        problem = _problem(fn, stack, chi, size, cut, work, out, backends) if link.nodes > 1 else {}
        seed = agree_on_call(link, fn, seed, problem)
        if stack.n_sites < MIN_SWEEP_SITES:
            # every node computes it; with ``out`` node 0 writes it
            writes = out is not None and link.node_rank == 0
            result = _exact(fn, stack, chi, cut, work, out if writes else None)
            result = None if out is not None and not writes else result
        else:
            logger.debug(
                "%s: %d sites, %d layers, result %s, chi_out=%d, sketch=%d, dtype=%s, "
                "device=%s, nodes=%d",
                fn,
                stack.n_sites,
                len(stack.layers),
                stack.kind,
                chi,
                size,
                work,
                where,
                link.nodes,
            )
            if where == "cpu":
                stack = prepare(stack, work)
            result = execute(
                fn,
                stack,
                SketchSource(seed, size, sketch),
                work,
                cutoff=cut,
                truncate_to=chi if size > chi else None,
                resources=res,
                backends=backends,
                out=out,
                link=link,
            )
    if out is not None or result is None:
        return result  # datasets; None on the nodes that do not write
    return opened.result(result, stack.kind)


def _problem(
    fn: str,
    stack: Stack,
    chi: int,
    size: int,
    cut: float,
    work: np.dtype,
    out: object,
    backends: Sequence[Any],
) -> dict[str, object]:
    """The facts of one call that every node must share (`nodes.agree_on_call`)."""
    return {
        "function": fn,
        "trains": problem_key({"shapes": [stack.shapes(j) for j in range(stack.n_sites)]}),
        "input dtype": str(stack.dtype),
        "chi_out": chi,
        "sketch": size,
        "cutoff": cut,
        "dtype": str(work),
        "out": out is not None,
        # the GPUs' precision choices (`TorchBackend.products`)
        "gpu products": sorted({str(getattr(xp, "products", "")) for xp in backends}),
    }


def _exact(fn: str, stack: Stack, chi: int, cut: float, work: np.dtype, out: object) -> list[Any]:
    """Two-site stacks: contracted and truncated exactly, with a warning."""
    logger.warning(
        "%s: %d sites; the randomized sweep needs 3 or more, so the stack is "
        "contracted and truncated exactly",
        fn,
        stack.n_sites,
    )
    cores = exact_two_sites([stack.read(0), stack.read(1)], chi, cut, work)
    if out is None:
        return unpad(cores, stack.kind)
    sink = DatasetSink(out, stack.n_sites, stack.kind)
    for j, core in enumerate(cores):
        sink.put(j, core)
    return sink.result()


def src(
    *trains: Sequence[Any],
    chi_out: int | np.integer,
    cutoff: float = 0.0,
    oversample: float | None = 1.0,
    dtype: DTypeLike | None = None,
    seed: int | np.random.Generator | None = None,
    device: str | None = "cpu",
    resources: Resources | None = None,
    out: object = None,
) -> Any:
    """Contract a stack of tensor trains and compress the product in one SRC sweep.

    Successive randomized compression (Camaño, Epperly and Tropp,
    arXiv:2504.06475) sketches the product from the left with a Khatri-Rao
    Gaussian test tensor, then builds the output right to left, each core an
    orthonormal basis of a sketch.

    The stack ``src(T_1, T_2, ..., T_m)`` is the product ``T_1 T_2 ... T_m`` in
    mathematical order: the ``d`` leg of each train meets the ``u`` leg of the
    next, so ``T_m`` acts first. Accepted stacks: one MPS or one MPO (plain
    compression); MPOs (an MPO); MPOs then an MPS (a ket); an MPS then MPOs
    (the row vector ``phi^T A_1 ... A_k``, not conjugated: an MPS on the ``d``
    leg of ``A_k``). Pass ``[t.conj() for t in psi]`` for the bra ``<psi|``.

    Parameters
    ----------
    *trains : lists of array-likes
        Each train a list of per-site arrays in quimb's layout: MPO bulk
        ``(l, r, u, d)``, MPS bulk ``(l, r, p)``, boundary sites without the
        outer bond. A site may be any array-like with ``shape``, ``dtype`` and
        ``np.asarray`` (``np.memmap``, an HDF5 or zarr dataset, a torch
        tensor or CuPy array); it is read when the sweep reaches it, once per
        pass. A quimb ``MatrixProductState`` or ``MatrixProductOperator`` is
        read by its index names.
    chi_out : int
        The largest bond dimension of the result. Above the product's rank
        at every cut (bounded by its bonds and physical legs) it truncates
        nothing and costs no more than that rank.
    cutoff : float, default 0.0
        Drop singular values below ``cutoff * sigma_max``: in the sketch's basis,
        or in the final SVD pass when oversampling. Must lie in ``[0, 1)``.
    oversample : float or None, default 1.0
        Sketch size ``ceil(oversample * chi_out)`` (at most the largest rank a
        cut can have), finite and at least 1;
        ``None`` is the paper's ``max(ceil(1.5 chi_out), chi_out + 10)``. A
        sketch bigger than ``chi_out`` is followed by an exact SVD truncation
        to ``chi_out``.
    dtype : dtype-like, optional
        The sketch dtype. Defaults to the inputs' promoted floating dtype
        (complex Ginibre sketches for complex inputs). The result has the
        sketch dtype promoted with the inputs'.
    seed : int or numpy.random.Generator, optional
        Seeds the sketches (anything `numpy.random.default_rng` takes); the
        same seed gives the same result.
    device : {"cpu", "gpu", "cuda"} or None, default "cpu"
        Where the sweep runs: NumPy on the host, or PyTorch on a GPU
        (``"gpu"`` and ``"cuda"`` are the same); None: on a GPU when a site
        lives on one.
    resources : Resources, optional
        Memory budgets (detected when unset), the scratch directory for
        environments that do not fit, and the devices to split the sketch
        columns over (``devices=2`` or ``[0, 1]``; simulated ranks on the CPU).
    out : h5py or zarr group, or path, optional
        Where to write the output cores as the sweep makes them (datasets
        ``"0"``, ``"1"``, ... of the group, or ``0.npy``, ... in the
        directory), so that an output larger than memory never sits in memory.

    Returns
    -------
    list of numpy.ndarray, or of datasets, or a quimb object
        The compressed train in quimb's layout (a quimb MPS or MPO, names and
        tags kept, when a train was one): right-canonical, or
        left-canonical (norm on the last site) after an oversampled sweep.
        Two-site stacks are contracted and truncated exactly (right-canonical),
        with a logged warning. With ``out``, the datasets written there (or
        read-only memmaps of the ``.npy`` files).

    Raises
    ------
    TypeError
        ``chi_out`` not an integer, a train or site of the wrong type (or of
        float16), a ``seed`` NumPy cannot take, an unknown layout, or an MPS
        in the middle or at both ends.
    ValueError
        ``chi_out < 1``; ``cutoff`` outside ``[0, 1)``; ``oversample`` below 1
        or not finite; an empty stack or train; a closed boundary; bonds that
        disagree; trains of different lengths; physical legs that do not
        join; one-site trains; an unknown device; ``devices`` naming a GPU
        that is not visible.
    MemoryError
        A budget of `Resources` (or the detected one) is smaller than the
        sweep's working set; the message says by how much.
    ImportError, RuntimeError
        ``device="gpu"`` without torch, or without CUDA.

    Examples
    --------
    >>> psi2 = src(U2, U1, psi, chi_out=64, seed=0)  # U2 U1 |psi>  # doctest: +SKIP
    """
    names = [f"trains[{i}]" for i in range(len(trains))]
    call = StackCall(
        "src",
        trains,
        names,
        chi_out,
        StackOptions(cutoff, oversample, dtype, seed, device, resources, out),
    )
    return run_stack(call)


def apply(
    left_tensor: Sequence[Any],
    right_tensor: Sequence[Any],
    chi_out: int | np.integer,
    *,
    cutoff: float = 0.0,
    oversample: float | None = 1.0,
    dtype: DTypeLike | None = None,
    seed: int | np.random.Generator | None = None,
    device: str | None = "cpu",
    resources: Resources | None = None,
    out: object = None,
) -> Any:
    """Apply an MPO to an MPS or an MPO and compress the product by SRC.

    ``apply(A, B, chi_out)`` is ``src(A, B, chi_out=chi_out)`` with an MPO on the
    left: ``A |psi>`` for an MPS ``B``, the product ``A B`` for an MPO ``B``
    (Camaño, Epperly and Tropp, arXiv:2504.06475). See `src` for the layouts
    and the keyword arguments.

    Parameters
    ----------
    left_tensor : list of array-likes
        The MPO ``A``.
    right_tensor : list of array-likes
        The MPS or MPO ``B``.
    chi_out : int
        The largest bond dimension of the result.
    cutoff, oversample, dtype, seed, device, resources, out
        As in `src`.

    Returns
    -------
    list of numpy.ndarray
        An MPS if ``B`` is one, else an MPO.

    Raises
    ------
    TypeError
        ``left_tensor`` is not an MPO, and everything `src` raises.
    ValueError
        As in `src`.
    """
    first = _first_rank(left_tensor)
    if first is not None and first != 3:
        raise TypeError(
            f"apply: left_tensor (train 0) must be an MPO (first site rank 3, (r, u, d)), "
            f"got a first site of rank {first}; for an MPS on the left use "
            "src(phi, mpo, chi_out=...)."
        )
    call = StackCall(
        "apply",
        (left_tensor, right_tensor),
        ("left_tensor", "right_tensor"),
        chi_out,
        StackOptions(cutoff, oversample, dtype, seed, device, resources, out),
    )
    return run_stack(call)


def compress(
    tensor: Sequence[Any],
    chi_out: int | np.integer,
    *,
    cutoff: float = 0.0,
    oversample: float | None = 1.0,
    dtype: DTypeLike | None = None,
    seed: int | np.random.Generator | None = None,
    device: str | None = "cpu",
    resources: Resources | None = None,
    out: object = None,
) -> Any:
    """Compress one MPS or MPO to bond dimension ``chi_out`` by SRC.

    ``compress(T, chi_out)`` is ``src(T, chi_out=chi_out)`` (Camaño, Epperly and
    Tropp, arXiv:2504.06475). See `src` for the layouts and keyword arguments.

    Parameters
    ----------
    tensor : list of array-likes
        The MPS or MPO.
    chi_out : int
        The largest bond dimension of the result.
    cutoff, oversample, dtype, seed, device, resources, out
        As in `src`.

    Returns
    -------
    list of numpy.ndarray
        The compressed train, of the input's kind.

    Raises
    ------
    TypeError, ValueError
        As in `src`.
    """
    call = StackCall(
        "compress",
        (tensor,),
        ("tensor",),
        chi_out,
        StackOptions(cutoff, oversample, dtype, seed, device, resources, out),
    )
    return run_stack(call)


def _first_rank(train: object) -> int | None:
    """The rank of a train's first site, or None when that is not yet checkable."""
    kind = quimb_kind(train)
    if kind is not None:
        return 2 if kind == "mps" else 3
    if not isinstance(train, Sequence) or isinstance(train, str | bytes) or len(train) == 0:
        return None
    shape = getattr(train[0], "shape", None)
    return None if shape is None else len(shape)
