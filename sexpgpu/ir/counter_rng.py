"""A counter-based generator: uniform numbers as a hash of integers, the same on every device.

The IR's ``uniform`` op maps an int32 *key* and an int32 *counter* (both
broadcast elementwise) and its node's *salt* to a float32 in ``[0, 1)``;
``dropout`` uses it with the microbatch's key and each element's position
as the counter. Nothing is stored between calls, so the numbers depend on
those integers alone: any device, stacking degree, rank count or resume
that feeds the same key and counters draws the same numbers, bit for bit.

On 32-bit words (``mix`` is a bijective integer hash: xor-shifts and odd
multipliers)::

    k  = mix(key ^ mix(salt))
    h  = mix(mix(counter + k) ^ mix(k + GOLDEN))
    u  = (h >> 8) * 2**-24                      # 24 bits: exact in float32

For one key, distinct counters give distinct ``h`` (each step is a
bijection); the second ``mix`` keyed again by ``k`` keeps two keys' streams
from being shifted copies of each other. A microbatch's key comes from the
run's seed and the global microbatch index (`microbatch_key`), computed on
the host by the loader.

`uniform_bits` is the NumPy reference; the cuda lowering computes the same
words in int64 arithmetic masked to 32 bits (torch has no full uint32
arithmetic), and a test holds the two equal.
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = [
    "GOLDEN",
    "KEY_FIELD",
    "MIX_MULTIPLIERS",
    "microbatch_key",
    "mix32",
    "salt_of",
    "uniform_bits",
]

# The fed field holding one microbatch's key (int32, shape []). The '#' keeps it
# apart from every data field a user can name.
KEY_FIELD = "#dropout-key"
MIX_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
GOLDEN = 0x9E3779B9
_MASK = 0xFFFFFFFF


def mix32(x: np.ndarray) -> np.ndarray:
    """A bijective hash of uint32 words (xor-shift, multiply, twice; wraps mod 2**32)."""
    x = np.asarray(x, dtype=np.uint32)
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(MIX_MULTIPLIERS[0])
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(MIX_MULTIPLIERS[1])
        return x ^ (x >> np.uint32(16))


def uniform_bits(key: np.ndarray, counter: np.ndarray, salt: int) -> np.ndarray:
    """float32 numbers in [0, 1) for int32 `key` and `counter` (broadcast) and `salt`."""
    k = mix32(key.astype(np.int64).astype(np.uint32) ^ mix32(np.uint32(salt)))
    c = counter.astype(np.int64).astype(np.uint32)
    with np.errstate(over="ignore"):
        h = mix32(mix32(c + k) ^ mix32(k + np.uint32(GOLDEN)))
    return ((h >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24)).astype(np.float32)


def microbatch_key(seed: int, index: int) -> np.ndarray:
    """The int32 key of global microbatch `index` of a run seeded `seed` (a rank-0 array)."""
    seed = int(seed) % 2**64
    words = mix32(np.uint32(seed & _MASK)) ^ mix32(np.uint32((seed >> 32) ^ GOLDEN))
    index = int(index) % 2**64
    with np.errstate(over="ignore"):
        low = mix32(words + np.uint32(index & _MASK))
        key = mix32(low ^ np.uint32(index >> 32))
    return np.array(key, dtype=np.uint32).view(np.int32).reshape(())


def salt_of(path: str) -> int:
    """A 31-bit salt from a call's path (``gpt/block.3/dropout``): one stream per call site."""
    digest = hashlib.sha256(path.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF
