"""The counter-based generator behind dropout: pinned numbers, uniform, a stream per key, salt."""

import numpy as np
import pytest

from sexpgpu.ir.counter_rng import microbatch_key, salt_of, uniform_bits


def test_numbers_are_pinned():
    # Changing these changes every dropout mask of every run: docs/ir.md's spec.
    got = uniform_bits(np.array(-7, np.int32), np.arange(4, dtype=np.int32), 12345)
    assert got.tolist() == pytest.approx([0.8926868, 0.36820567, 0.8641175, 0.93732274])
    assert int(microbatch_key(3, 0)) == int(microbatch_key(3, 0))
    assert salt_of("gpt/block.3/dropout") == salt_of("gpt/block.3/dropout")


def test_the_cuda_lowering_draws_the_same_words():
    torch = pytest.importorskip("torch")
    from sexpgpu.devices.cuda.lowering import LOWERINGS
    from sexpgpu.ir import builder as b
    from sexpgpu.ir.ops import Op

    rng = np.random.default_rng(0)
    keys = rng.integers(-(2**31), 2**31, (7, 1), dtype=np.int64).astype(np.int32)
    counters = np.concatenate([np.arange(50), [2**31 - 1, 2**31 - 2]]).astype(np.int32)
    node = b.uniform(b.input("k", keys.shape, "int32"), b.input("c", counters.shape, "int32"), 99)
    got = LOWERINGS[Op.UNIFORM](node, torch.from_numpy(keys), torch.from_numpy(counters))
    np.testing.assert_array_equal(got.numpy(), uniform_bits(keys, counters, 99))


def test_numbers_are_uniform_and_streams_differ():
    n = 1 << 16
    counters = np.arange(n, dtype=np.int32)
    u = uniform_bits(np.array(5, np.int32), counters, 1)
    assert u.dtype == np.float32 and u.min() >= 0.0 and u.max() < 1.0
    counts, _ = np.histogram(u, bins=16, range=(0, 1))
    chi2 = float(((counts - n / 16) ** 2 / (n / 16)).sum())
    assert chi2 < 60  # 15 degrees of freedom: far in the tail of a fair generator
    neighbours = [uniform_bits(np.array(k, np.int32), counters, 1) for k in (6, 7)]
    neighbours.append(uniform_bits(np.array(5, np.int32), counters, 2))
    for other in neighbours:  # another key or salt: uncorrelated, not shifted copies
        assert abs(np.corrcoef(u, other)[0, 1]) < 0.02
        assert abs(np.corrcoef(u[1:], other[:-1])[0, 1]) < 0.02
    assert len(np.unique(u)) > 0.99 * n


def test_microbatch_keys_are_distinct():
    keys = {int(microbatch_key(seed, g)) for seed in (0, 1, 1337) for g in range(2000)}
    assert len(keys) == 6000
    assert microbatch_key(2**40 + 3, 2**33).dtype == np.int32


def test_the_interpreter_split_over_threads_draws_the_same_numbers():
    from sexpgpu.devices.cpu import CpuProgram
    from sexpgpu.devices.cpu_split import MIN_ELEMENTS
    from sexpgpu.ir import builder as b
    from sexpgpu.ir.node import Graph

    key = b.input("k", (), "int32")
    rows = MIN_ELEMENTS // 256
    u = b.uniform(key, b.iota((rows, 512), 1), 7)
    graph = Graph.of({"u": b.mul(u, b.constant(2.0, "f32"))}, [key])
    feeds = {"k": np.array(3, np.int32)}
    want = 2 * uniform_bits(np.array(3, np.int32), np.broadcast_to(np.arange(512), (rows, 512)), 7)
    for workers in (1, 4):
        got = CpuProgram(graph, threads=workers)(feeds)["u"]
        np.testing.assert_array_equal(got, want)
