"""Parameter initializers: what ``(param [shape] :init INIT)`` asks for, and drawing it.

=====================  ==================================================
INIT                   values
=====================  ==================================================
``(normal std)``       normal with mean 0 and standard deviation ``std``
``(uniform lo hi)``    uniform on ``[lo, hi)``
``zeros``, ``ones``    constant 0 or 1
``xavier``             uniform on ``[-a, a)``, ``a = sqrt(6 / (fan_in + fan_out))``
=====================  ==================================================

For a shape ``[... in out]`` the fans are ``in`` and ``out`` times the
product of the leading axes; a vector has both fans equal to its length.
`draw` takes the generator to use, so that the caller decides the stream
(`sexpgpu.ir.compile.CompiledRun.init_params` derives one per parameter from the seed and the
parameter's path name).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

__all__ = ["INITIALIZERS", "Init", "draw", "param_rng"]

# name -> number of numeric arguments
INITIALIZERS: dict[str, int] = {"normal": 1, "uniform": 2, "zeros": 0, "ones": 0, "xavier": 0}


@dataclass(frozen=True)
class Init:
    """An initializer: its name (a key of `INITIALIZERS`) and its numeric arguments."""

    kind: str
    args: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        assert INITIALIZERS.get(self.kind) == len(self.args), self

    def __str__(self) -> str:
        if not self.args:
            return self.kind
        return "(" + " ".join([self.kind, *(f"{a:g}" for a in self.args)]) + ")"


def _fans(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) < 2:
        n = shape[0] if shape else 1
        return n, n
    receptive = math.prod(shape[:-2])
    return shape[-2] * receptive, shape[-1] * receptive


def draw(init: Init, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A float32 array of `shape` drawn from `init` with `rng`.

    Parameters
    ----------
    init
        The initializer.
    shape
        The parameter's shape.
    rng
        The generator (consumed only by the random initializers).
    """
    if init.kind == "zeros":
        return np.zeros(shape, np.float32)
    if init.kind == "ones":
        return np.ones(shape, np.float32)
    if init.kind == "normal":
        (std,) = init.args
        values = rng.standard_normal(shape, dtype=np.float32)
        values *= np.float32(std)
        return values
    if init.kind == "uniform":
        lo, hi = init.args
        return rng.uniform(lo, hi, shape).astype(np.float32)
    assert init.kind == "xavier", init
    fan_in, fan_out = _fans(shape)
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-bound, bound, shape).astype(np.float32)


def param_rng(seed: int, name: str) -> np.random.Generator:
    """The generator of parameter `name` under `seed`: independent of every other name.

    The stream is seeded with the run's seed and a SHA-256 digest of the path
    name, so adding or renaming one parameter leaves the others' values alone.
    """
    digest = hashlib.sha256(name.encode()).digest()
    words = [int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4)]
    seed = int(seed) % 2**64
    return np.random.default_rng(np.random.SeedSequence([seed & 0xFFFFFFFF, seed >> 32, *words]))
