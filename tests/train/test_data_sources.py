import json

import numpy as np
import pytest
from tiny_lm import TEXT, write_tiny_lm

from sexpgpu.cli import main
from sexpgpu.errors import SexpgpuError
from sexpgpu.lang import load_experiment_text
from sexpgpu.train.data import LLMC_MAGIC, make_loader


def _llmc(path, tokens, version=1, count=None, dtype="<u2"):
    header = np.zeros(256, "<i4")
    header[:3] = LLMC_MAGIC, version, len(tokens) if count is None else count
    path.write_bytes(header.tobytes() + np.asarray(tokens, dtype).tobytes())


def _data(tmp_path, source, extra="", seq=":seq 4"):
    text = f"(defdata d {source} {seq} {extra})"
    return load_experiment_text(text, "t.lisp", base_dir=tmp_path).data["d"]


def test_llmc_token_files_are_read_after_their_header(tmp_path):
    tokens = np.arange(100) * 7 % 50_000
    _llmc(tmp_path / "a.bin", tokens)
    loader = make_loader(_data(tmp_path, '(tokens "a.bin")', ":split 0.5"), batch=2)
    assert "llm.c token file, version 1, 100 u16 tokens" in loader.layout
    batch = loader.eval_batches(1)[0]
    np.testing.assert_array_equal(batch["tokens"][0], tokens[50:54])
    np.testing.assert_array_equal(batch["next"][0], tokens[51:55])
    _llmc(tmp_path / "b.bin", tokens + 70_000, version=2, dtype="<u4")
    loader = make_loader(_data(tmp_path, '(tokens "b.bin")', ":split 0.5"), batch=2)
    assert "version 2, 100 u32 tokens" in loader.layout
    assert loader.eval_batches(1)[0]["tokens"][0, 0] == tokens[50] + 70_000


def test_headerless_files_are_said_to_be_headerless(tmp_path):
    (tmp_path / "h.bin").write_bytes(np.arange(64, dtype="<u2").tobytes())
    loader = make_loader(_data(tmp_path, '(tokens "h.bin")'), batch=2)
    assert loader.layout.endswith("(headerless, 64 u16 tokens)")


@pytest.mark.parametrize(
    ("version", "count", "code", "message"),
    [
        (3, None, "E-DATA-003", "llm.c token file of version 3"),
        (1, 500, "E-DATA-003", "header says 500 u16 tokens, but the file holds 200 bytes"),
        (1, 0, "E-DATA-002", "llm.c token file of no tokens"),
    ],
)
def test_bad_llmc_headers_are_coded(tmp_path, version, count, code, message):
    _llmc(tmp_path / "a.bin", np.arange(100), version=version, count=count)
    with pytest.raises(SexpgpuError) as err:
        make_loader(_data(tmp_path, '(tokens "a.bin")'), batch=2)
    assert err.value.code == code and message in err.value.message


def test_an_eval_source_replaces_the_split(tmp_path):
    (tmp_path / "train.txt").write_bytes(bytes(range(65, 91)) * 4)
    (tmp_path / "val.txt").write_bytes(b"0123456789" * 2)
    data = _data(tmp_path, '(bytes "train.txt")', ':eval (bytes "val.txt")')
    assert data.options["split"] == 1.0 and data.eval.kind == "bytes"
    loader = make_loader(data, batch=2)
    assert "eval " in loader.layout and "val.txt" in loader.layout
    assert bytes(loader.eval_batches(1)[0]["tokens"][0].tolist()) == b"0123"
    seen = np.concatenate([b["tokens"].ravel() for b in loader.next_step()])
    assert seen.min() >= 65  # training reads all of train.txt and nothing of val.txt


def test_an_eval_source_of_arrays_evaluates_its_own_samples(tmp_path):
    np.savez(tmp_path / "a.npz", x=np.zeros((10, 3), np.float32), y=np.zeros(10, np.int32))
    np.savez(tmp_path / "b.npz", x=np.ones((4, 3), np.float32), y=np.ones(4, np.int32))
    data = _data(
        tmp_path, '(arrays "a.npz" :fields [x y])', ':eval (arrays "b.npz" :fields [x y])', ""
    )
    loader = make_loader(data, batch=3)
    assert (loader.eval_batches(2)[1]["x"] == 1).all()
    assert (loader.next_step()[0]["x"] == 0).all()
    np.savez(tmp_path / "c.npz", x=np.ones((4, 2), np.float32), y=np.ones(4, np.int32))
    data = _data(
        tmp_path, '(arrays "a.npz" :fields [x y])', ':eval (arrays "c.npz" :fields [x y])', ""
    )
    with pytest.raises(SexpgpuError) as err:
        make_loader(data, batch=3)
    assert err.value.code == "E-DATA-004" and "float32 [2]" in err.value.message


@pytest.mark.parametrize(
    ("extra", "code", "message"),
    [
        (':split 0.5 :eval (bytes "v.txt")', "E-FORM-003", "gives both `:split` and `:eval`"),
        (":eval (digits)", "E-FORM-005", "gives other fields than (bytes ...)"),
        (':eval "v.txt"', "E-FORM-005", "must be a call such as (bytes PATH)"),
        (":eval (nope)", "E-FORM-006", "unknown data source `nope`"),
    ],
)
def test_eval_source_misuse(tmp_path, extra, code, message):
    with pytest.raises(SexpgpuError) as err:
        _data(tmp_path, '(bytes "t.txt")', extra)
    assert err.value.code == code and message in err.value.message


def test_a_run_evaluates_on_its_eval_source_and_records_what_it_read(tmp_path, capsys):
    text = TEXT.replace(":split 0.8", ':eval (bytes "val.txt")')
    path = write_tiny_lm(tmp_path, text)
    (tmp_path / "val.txt").write_text("a completely different validation text " * 5)
    assert main(["run", str(path), "--out", str(tmp_path / "run"), "--steps", "2"]) == 0
    records = [
        json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n") if x
    ]
    notes = [r["value"] for r in records if r["name"] == "annotation"]
    assert any("eval " in n and "val.txt" in n for n in notes if n.startswith("data:"))
    capsys.readouterr()
    where = str(tmp_path / "run" / "checkpoints" / "step-2")
    assert main(["eval", str(path), "--resume", where]) == 0
    loss = json.loads(capsys.readouterr().out.splitlines()[-1])["loss"]
    assert loss == next(r["value"] for r in records if r["name"] == "eval/loss" and r["step"] == 2)
