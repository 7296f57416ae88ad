"""Moving values between devices, for the collectives of `sexpgpu.runtime.group`.

A value is a leaf or a list, tuple or dict of values. Leaves are NumPy arrays,
PyTorch tensors, Python numbers, or other objects. Copies never alias their
source, so a rank may change what it received without touching another rank's
data. PyTorch is used only when a leaf already is a tensor or the device is a
GPU; this module never imports it itself.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np

from sexpgpu.runtime.devices import Device, torch_if_loaded

__all__ = [
    "accumulate",
    "add",
    "copy_to",
    "is_tensor",
    "read_on",
    "ready",
    "settle",
    "tree_map",
]

# Immutable leaves that every rank may share.
_SHARED = (int, float, complex, bool, str, bytes, type(None), np.generic)


def is_tensor(x: Any) -> bool:
    """Whether `x` is a PyTorch tensor (without importing PyTorch)."""
    torch = torch_if_loaded()
    return torch is not None and isinstance(x, torch.Tensor)


def tree_map(fn: Callable[..., Any], *trees: Any) -> Any:
    """`fn` applied leaf by leaf to trees of one structure (lists, tuples, dicts)."""
    first = trees[0]
    if isinstance(first, (list, tuple)):
        assert all(len(t) == len(first) for t in trees), "trees differ in length"
        items = [tree_map(fn, *parts) for parts in zip(*trees, strict=True)]
        return type(first)(items) if isinstance(first, list) else tuple(items)
    if isinstance(first, dict):
        assert all(t.keys() == first.keys() for t in trees), "trees differ in keys"
        return {key: tree_map(fn, *(t[key] for t in trees)) for key in first}
    return fn(*trees)


def copy_to(x: Any, device: Device) -> Any:
    """A copy of the value `x` that lives on `device` and shares no memory with `x`.

    NumPy arrays stay NumPy arrays (host memory serves every simulated rank);
    tensors move to the device's PyTorch device; other leaves are deep-copied.
    """
    return tree_map(lambda leaf: _copy_leaf(leaf, device), x)


def _copy_leaf(leaf: Any, device: Device) -> Any:
    if isinstance(leaf, np.ndarray):
        return np.array(leaf, copy=True)
    if isinstance(leaf, _SHARED):
        return leaf
    if is_tensor(leaf):
        # Across GPUs PyTorch orders the copy after the work queued on both
        # devices' current streams, and the destination's stream after the copy.
        return leaf.to(device.torch_device(), copy=True)
    return copy.deepcopy(leaf)


def read_on(x: Any, device: Device) -> Any:
    """`x` itself where it already lives on `device`, else a copy there: for reading only."""
    return tree_map(lambda leaf: leaf if _lives_on(leaf, device) else _copy_leaf(leaf, device), x)


def _lives_on(leaf: Any, device: Device) -> bool:
    # Host arrays are readable from every rank's thread; tensors where they are.
    if isinstance(leaf, (np.ndarray, *_SHARED)):
        return True
    return is_tensor(leaf) and leaf.device == device.torch_device()


def accumulate(total: Any, x: Any) -> Any:
    """``total + x`` leaf by leaf, written into `total`'s arrays where dtype and shape allow.

    `total` must be owned by the caller (a fresh copy). In-place and
    out-of-place sums round alike, so the result is bitwise that of ``total + x``.
    """
    return tree_map(_accumulate_leaf, total, x)


def _accumulate_leaf(total: Any, x: Any) -> Any:
    if isinstance(total, np.ndarray) and isinstance(x, np.ndarray):
        if np.result_type(total, x) == total.dtype and _keeps_shape(total.shape, x.shape):
            return np.add(total, x, out=total)
    elif is_tensor(total) and is_tensor(x) and total.device == x.device:
        torch = torch_if_loaded()
        if torch.result_type(total, x) == total.dtype and _keeps_shape(total.shape, x.shape):
            return total.add_(x)
    return total + x


def _keeps_shape(shape: tuple[int, ...], other: tuple[int, ...]) -> bool:
    try:
        return tuple(np.broadcast_shapes(tuple(shape), tuple(other))) == tuple(shape)
    except ValueError:
        return False


def add(a: Any, b: Any) -> Any:
    """The leafwise sum ``a + b`` of two values of one structure (new objects)."""
    return tree_map(lambda u, v: u + v, a, b)


def ready(x: Any, device: Device) -> None:
    """Wait until the work that computes `x` on `device` is done.

    A GPU rank calls this before other ranks read `x`, whatever stream
    produced it; host values are always ready.
    """
    if device.is_cuda and _has_tensor(x):
        settle(device)


def settle(device: Device) -> None:
    """Wait for the work queued on `device` (a GPU) by this thread; no-op on cpu."""
    if device.is_cuda:
        torch = torch_if_loaded()
        if torch is not None:
            torch.cuda.current_stream(device.index).synchronize()


def _has_tensor(x: Any) -> bool:
    found = False

    def visit(leaf: Any) -> None:
        nonlocal found
        found = found or is_tensor(leaf)

    tree_map(visit, x)
    return found
