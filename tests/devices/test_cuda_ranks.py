"""The cuda lowering over simulated ranks: a rank plans and runs its own share of a step.

Two ranks of two microbatches each train as one rank of four, each rank's
fused graph compiled to return its sums where its step is one call, and to
add them into buffers otherwise. Runs on PyTorch's CPU device.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sexpgpu.devices.base import DEVICES  # noqa: E402
from sexpgpu.devices.cuda.device import CudaDevice  # noqa: E402
from sexpgpu.train import prepare_run  # noqa: E402
from sexpgpu.train.metrics import read_series  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler for Inductor")

MLP = """
(defdata digits (digits) :split 0.9)
(defmodel mlp (x) (-> x (linear 16) gelu (linear 10)))
(defrun train
  :model mlp :data digits :loss (cross-entropy (mlp x) y)
  :optimizer (adamw :lr 1e-2) :batch 8 :microbatches 4 :steps 3 :seed 5)
"""


def _train(tmp_path: Path, name: str, devices: str, monkeypatch) -> tuple[list[float], list]:
    path = tmp_path / "mlp.lisp"
    path.write_text(MLP)
    # Each measured choice would be remembered beside the user's.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    environ = {"SEXPGPU_DEVICES": devices}
    monkeypatch.setitem(DEVICES, "cpu", lambda: CudaDevice("cpu", fuse=True))
    trainer = prepare_run(
        path,
        out=tmp_path / name,
        device="cpu",
        environ=environ,
    )
    programs = []
    make = trainer.make_program

    def kept(rank: int):
        programs.append(make(rank))
        return programs[-1]

    trainer.make_program = kept
    trainer.run()
    losses = read_series(tmp_path / name, "train/loss")
    return [losses[s] for s in sorted(losses)], programs


def test_two_ranks_of_two_equal_one_rank_of_four(tmp_path: Path, monkeypatch) -> None:
    one, [whole] = _train(tmp_path, "one", "0", monkeypatch)
    two, ranks = _train(tmp_path, "two", "0,1", monkeypatch)
    np.testing.assert_allclose(two, one, rtol=1e-5)
    assert len(ranks) == 2
    for program, microbatches in [(whole, 4), *((rank, 2) for rank in ranks)]:
        fused = program.graphs.fused
        assert fused is not None
        # A rank's step of one call returns its sums; of several, it adds them into buffers.
        assert (not fused.sums) == (program.graphs.degree == microbatches), program.graphs.degree
