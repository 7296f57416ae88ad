import json

import numpy as np
import pytest
from standin_program import defdata

from sexpgpu.errors import SexpgpuError
from sexpgpu.train.data import make_loader, python_stdlib_bytes


def _bytes_file(tmp_path, n=5000, seed=0):
    path = tmp_path / "corpus.txt"
    path.write_bytes(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes())
    return path


def _stream(tmp_path, **layout):
    data = defdata("text", f'(bytes "{_bytes_file(tmp_path)}")', seq=8)
    return make_loader(data, **({"batch": 4, "seed": 7} | layout))


def test_byte_windows_are_shifted_pairs_from_the_training_part(tmp_path):
    loader = _stream(tmp_path)
    raw = np.fromfile(tmp_path / "corpus.txt", dtype=np.uint8)
    (batch,) = loader.next_step()
    assert batch["tokens"].shape == batch["next"].shape == (4, 8)
    assert batch["tokens"].dtype == np.int32
    assert np.array_equal(batch["tokens"][:, 1:], batch["next"][:, :-1])
    cut = int(len(raw) * 0.9)
    for row in batch["tokens"]:  # every window comes from the training part
        hits = [s for s in range(cut - 8) if np.array_equal(raw[s : s + 8], row)]
        assert hits
    assert loader.fields == {"tokens": ((4, 8), "int32"), "next": ((4, 8), "int32")}
    assert loader.items_per_microbatch == 32


def test_eval_windows_are_fixed_and_from_the_eval_part(tmp_path):
    loader = _stream(tmp_path)
    raw = np.fromfile(tmp_path / "corpus.txt", dtype=np.uint8)
    cut = int(len(raw) * 0.9)
    a, b = loader.eval_batches(2), loader.eval_batches(2)
    assert all(np.array_equal(x["tokens"], y["tokens"]) for x, y in zip(a, b, strict=True))
    assert np.array_equal(a[0]["tokens"][0], raw[cut : cut + 8])
    assert np.array_equal(a[0]["next"][0], raw[cut + 1 : cut + 9])


def test_same_seed_same_batches_and_restore_continues_exactly(tmp_path):
    a, b = _stream(tmp_path), _stream(tmp_path)
    first = [a.next_step()[0]["tokens"] for _ in range(3)]
    assert all(np.array_equal(x, b.next_step()[0]["tokens"]) for x in first)
    state = json.loads(json.dumps(a.state()))  # JSON-able
    after = a.next_step()[0]["tokens"]
    c = _stream(tmp_path)
    c.restore(state)
    assert np.array_equal(c.next_step()[0]["tokens"], after)
    other = _stream(tmp_path, seed=8).next_step()[0]["tokens"]
    assert not np.array_equal(other, first[0])


def test_rank_shares_make_up_the_single_rank_step(tmp_path):
    whole = _stream(tmp_path, microbatches=4).next_step()
    shares = [_stream(tmp_path, microbatches=4, rank=r, ranks=2).next_step() for r in (0, 1)]
    joined = shares[0] + shares[1]
    assert len(whole) == 4 and len(shares[0]) == 2
    assert all(np.array_equal(x["tokens"], y["tokens"]) for x, y in zip(whole, joined, strict=True))


def test_microbatches_that_do_not_divide_are_e_dp_003(tmp_path):
    with pytest.raises(SexpgpuError) as info:
        _stream(tmp_path, microbatches=3, rank=0, ranks=2)
    assert info.value.code == "E-DP-003"


def test_restore_on_another_rank_layout_is_e_dp_002(tmp_path):
    state = _stream(tmp_path, microbatches=2, rank=0, ranks=2).state()
    with pytest.raises(SexpgpuError) as info:
        _stream(tmp_path, microbatches=2).restore(state)
    assert info.value.code == "E-DP-002"
    assert "rank 0 of 2" in info.value.message


@pytest.mark.parametrize(("dtype", "np_dtype"), [("u16", "<u2"), ("u32", "<u4")])
def test_token_files_are_memory_mapped(tmp_path, dtype, np_dtype):
    path = tmp_path / "tokens.bin"
    values = np.arange(3000, dtype=np_dtype) * 7 % 50000
    values.tofile(path)
    data = defdata("toks", f'(tokens "{path}" :dtype {dtype})', seq=16, split=0.5)
    loader = make_loader(data, batch=2, seed=0)
    assert isinstance(loader._train_part.base, np.memmap) or isinstance(
        loader._train_part, np.memmap
    )
    (batch,) = loader.next_step()
    start = np.flatnonzero(values == batch["tokens"][0, 0])[0]
    assert np.array_equal(batch["tokens"][0], values[start : start + 16])


def test_arrays_split_is_disjoint_and_epochs_cover_every_sample(tmp_path):
    path = tmp_path / "set.npz"
    np.savez(path, x=np.arange(40, dtype=np.float64).reshape(20, 2), y=np.arange(20))
    data = defdata("set", f'(arrays "{path}" :fields [x y])', split=0.75)
    loader = make_loader(data, batch=5, seed=3)
    seen = np.concatenate([loader.next_step()[0]["y"] for _ in range(3)])  # one epoch: 15
    evals = np.concatenate([b["y"] for b in loader.eval_batches(1)])
    assert sorted(seen) == sorted(set(range(20)) - set(evals))
    assert loader.next_step()[0]["x"].dtype == np.float32
    assert len(set(evals)) == 5


def test_digits_yield_scaled_pixels_and_labels():
    loader = make_loader(defdata("d", "(digits)"), batch=32, seed=0)
    (batch,) = loader.next_step()
    assert batch["x"].shape == (32, 64) and batch["x"].dtype == np.float32
    assert batch["x"].min() >= 0.0 and batch["x"].max() <= 1.0
    assert batch["y"].dtype == np.int32 and set(batch["y"]) <= set(range(10))
    assert loader.fields == {"x": ((32, 64), "float32"), "y": ((32,), "int32")}


def test_python_stdlib_is_deterministic_text():
    blob = python_stdlib_bytes()
    assert len(blob) > 1_000_000
    assert blob is python_stdlib_bytes()  # cached
    assert b"def " in blob[:200_000].tobytes()
    data = defdata("text", "(python-stdlib)", seq=32)
    (batch,) = make_loader(data, batch=2, seed=1).next_step()
    assert batch["tokens"].shape == (2, 32)


def _error(data, **layout):
    with pytest.raises(SexpgpuError) as info:
        make_loader(data, **({"batch": 2} | layout))
    return info.value


def test_data_errors_name_the_file_and_the_fix(tmp_path):
    missing = _error(defdata("t", f'(bytes "{tmp_path / "nope.txt"}")', seq=4))
    assert missing.code == "E-DATA-001" and "nope.txt" in missing.message
    assert "relative to the experiment file" in missing.hint

    (tmp_path / "empty.txt").write_bytes(b"")
    empty = _error(defdata("t", f'(bytes "{tmp_path / "empty.txt"}")', seq=4))
    assert empty.code == "E-DATA-002" and "empty.txt is empty" in empty.message

    (tmp_path / "short.txt").write_bytes(b"0123456789")
    short = _error(defdata("t", f'(bytes "{tmp_path / "short.txt"}")', seq=8, split=0.5))
    assert short.code == "E-DATA-002" and "fewer than :seq + 1 = 9" in short.message

    (tmp_path / "odd.bin").write_bytes(b"abc")
    odd = _error(defdata("t", f'(tokens "{tmp_path / "odd.bin"}")', seq=1))
    assert odd.code == "E-DATA-003" and "3 bytes" in odd.message

    np.savez(tmp_path / "a.npz", x=np.zeros((4, 2)), y=np.zeros(3))
    field = _error(defdata("a", f'(arrays "{tmp_path / "a.npz"}" :fields [x label])'))
    assert field.code == "E-DATA-004" and "no field label" in field.message
    assert "x, y" in field.hint
    lengths = _error(defdata("a", f'(arrays "{tmp_path / "a.npz"}" :fields [x y])'))
    assert lengths.code == "E-DATA-004" and "different lengths" in lengths.message
