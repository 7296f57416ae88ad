"""Checks of the scalar arguments shared by `src`, `apply` and `compress`.

Each raises at once, naming the function, the argument and the fix, rather than
letting a bad value fail deep inside the sweep.
"""

from __future__ import annotations

import numbers
from math import ceil, isfinite

import numpy as np

from sexpgpu.runtime.devices import DEVICE_KINDS

from .resources import Resources

__all__ = [
    "check_chi_out",
    "check_cutoff",
    "check_device",
    "check_resources",
    "check_seed",
    "sketch_size",
]

# tn's device names: the runtime's kinds, and "gpu" for cuda (as quimb's users write it).
DEVICES: dict[str, str] = {"gpu": "cuda", **{kind: kind for kind in DEVICE_KINDS}}


def check_chi_out(fn: str, chi_out: object) -> int:
    """Return ``chi_out`` as an int; reject non-integers (TypeError) and values < 1."""
    if isinstance(chi_out, bool) or not isinstance(chi_out, numbers.Integral):
        raise TypeError(
            f"{fn}: chi_out must be an integer, got {chi_out!r} "
            f"({type(chi_out).__name__}); pass e.g. chi_out=64."
        )
    if chi_out < 1:
        raise ValueError(
            f"{fn}: chi_out must be a positive integer, got {chi_out}; pass the largest "
            "bond dimension to keep, e.g. chi_out=64."
        )
    return int(chi_out)


def check_cutoff(fn: str, cutoff: object) -> float:
    """Return ``cutoff`` as a float in ``[0, 1)``; anything else is a ValueError."""
    if (
        isinstance(cutoff, bool)
        or not isinstance(cutoff, numbers.Real)
        or not 0.0 <= float(cutoff) < 1.0
    ):
        raise ValueError(
            f"{fn}: cutoff must be a real number in [0, 1), got {cutoff!r}; it drops "
            "singular values below cutoff * sigma_max (0.0 keeps chi_out of them)."
        )
    return float(cutoff)


def sketch_size(fn: str, chi_out: int, oversample: object) -> int:
    """Return the sketch size: ``ceil(oversample * chi_out)``, or the paper's default.

    ``oversample=None`` gives ``max(ceil(1.5 chi_out), chi_out + 10)``.
    """
    if oversample is None:
        return max(ceil(1.5 * chi_out), chi_out + 10)
    if (
        isinstance(oversample, bool)
        or not isinstance(oversample, numbers.Real)
        or not isfinite(float(oversample))
        or float(oversample) < 1.0
    ):
        raise ValueError(
            f"{fn}: oversample must be a finite factor >= 1.0, got {oversample!r}; pass "
            "1.0 for no oversampling or None for max(1.5 chi_out, chi_out + 10)."
        )
    return ceil(float(oversample) * chi_out)


def check_seed(fn: str, seed: object) -> object:
    """Return ``seed`` when `numpy.random.default_rng` takes it; else say what it takes.

    Raises
    ------
    TypeError
        A seed of the wrong type (a string, a float).
    ValueError
        A negative integer.
    """
    try:
        np.random.default_rng(seed)  # type: ignore[arg-type]
    except (TypeError, ValueError) as err:
        raise type(err)(
            f"{fn}: seed must be None, a non-negative integer (or a sequence of them), a "
            f"numpy.random.SeedSequence or a numpy.random.Generator, got {seed!r}; pass e.g. "
            "seed=0."
        ) from None
    return seed


def check_device(fn: str, device: object, on_gpu: bool = False) -> str:
    """Return ``"cpu"`` or ``"cuda"`` (for ``"gpu"`` and ``"cuda"``), checking CUDA.

    ``None`` follows the sites: ``"cuda"`` when any lives on a GPU (``on_gpu``).

    Raises
    ------
    ValueError
        An unknown device.
    ImportError
        ``"gpu"`` without torch installed.
    RuntimeError
        ``"gpu"`` where torch sees no CUDA device.
    """
    if device is None:
        device = "gpu" if on_gpu else "cpu"
    if not isinstance(device, str) or device not in DEVICES:
        names = ", ".join(repr(name) for name in sorted(DEVICES))
        raise ValueError(
            f"{fn}: device must be {names} or None (where the sites are), got "
            f"{device!r}; pass device='cpu' "
            "for the NumPy sweep or device='gpu' for PyTorch on a GPU."
        )
    if DEVICES[device] == "cpu":
        return "cpu"
    try:
        import torch  # a device library, loaded only when asked for
    except ImportError as err:
        raise ImportError(
            f"{fn}: device={device!r} needs PyTorch with CUDA (pip install 'sexpgpu[cuda]'); "
            "use device='cpu' meanwhile."
        ) from err
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{fn}: device={device!r} but torch.cuda.is_available() is False (no CUDA device "
            "or a CPU-only PyTorch); use device='cpu'."
        )
    return DEVICES[device]


def check_resources(fn: str, resources: object) -> Resources | None:
    """Accept ``None``, a `Resources`, or an object with the same four fields."""
    fields = ("gpu_memory", "host_memory", "scratch_dir", "devices")
    if resources is None or isinstance(resources, Resources):
        return resources
    if all(hasattr(resources, f) for f in fields):  # e.g. another library's Resources
        return Resources(**{f: getattr(resources, f) for f in fields})
    raise TypeError(
        f"{fn}: resources must be a sexpgpu.tn.Resources or None, got "
        f"{type(resources).__name__}; pass e.g. Resources(host_memory='16GiB')."
    )
