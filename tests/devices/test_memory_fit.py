"""The memory plan with recomputation (`sexpgpu.devices.memory_fit`), on the cpu device."""

import json
from pathlib import Path

import numpy as np
import pytest

from sexpgpu.errors import SexpgpuError
from sexpgpu.train import run_experiment
from sexpgpu.train.metrics import read_series

pytestmark = pytest.mark.timeout(300)

GPT = Path(__file__).resolve().parents[2] / "examples" / "gpt.lisp"
# The smoke GPT's plan on the cpu is 17.5 MiB: parameters, adamw's moments, 12.4 MiB of live set.
TIGHT = "15MiB"


def _run(tmp_path, name, memory=None):
    environ = {} if memory is None else {"SEXPGPU_MEMORY": memory}
    out = tmp_path / name
    summary = run_experiment(
        str(GPT), variant="smoke", steps=3, out=out, device="cpu", environ=environ
    )
    return out, summary


def _annotations(run_dir):
    lines = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if isinstance(record.get("value"), str):
            lines.append(record["value"])
    return "\n".join(lines)


def test_a_run_that_recomputes_trains_the_same_bits(tmp_path):
    plain_dir, plain = _run(tmp_path, "plain")
    tight_dir, tight = _run(tmp_path, "tight", TIGHT)
    assert "recompute:" not in _annotations(plain_dir)
    assert "recompute:" in _annotations(tight_dir)
    losses = read_series(tight_dir, "train/loss")
    assert len(losses) == 3
    assert losses == read_series(plain_dir, "train/loss")
    # The interpreter frees each value after its last use: the recomputing graph holds less.
    peak = max(read_series(tight_dir, "runtime/peak_bytes").values())
    assert peak < max(read_series(plain_dir, "runtime/peak_bytes").values())
    for key in plain.params:
        assert np.array_equal(plain.params[key], tight.params[key]), key


def test_nothing_fits_even_recomputing(tmp_path):
    with pytest.raises(SexpgpuError) as error:
        _run(tmp_path, "none", "6MiB")
    assert error.value.code == "E-MEM-001"
    assert "even recomputing" in str(error.value.hint)
