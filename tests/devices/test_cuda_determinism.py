"""cuda runs repeat bit for bit on one GPU: twice, and through a SIGKILL and ``--resume latest``.

With ``SEXPGPU_DETERMINISTIC=1`` (`sexpgpu.devices.cuda.process`) a small
bf16 GPT (attention, an embedding's gradient, stacked microbatches) trains
twice in fresh processes to the same losses and checkpoint bytes; a third
run, killed after a checkpoint and resumed, ends with the same bits too.
Skipped without a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "train"))

from sigkill_helpers import kill_at_step  # noqa: E402

from sexpgpu.train.metrics import read_series  # noqa: E402

pytestmark = pytest.mark.gpu

GPT = """
(defdata text (python-stdlib) :seq 128 :split 0.9)
(defn block (x)
  (let [x (+ x (attention (layernorm x) :heads 4 :causal true))]
    (+ x (-> x layernorm (linear 1024) gelu (linear 256)))))
(defmodel gpt (tokens)
  (let [wte (param [256 256] :init (normal 0.02))]
    (-> (+ (take wte tokens) (embed (positions tokens) 128 256))
        (repeat 2 block) layernorm (matmul (transpose wte)))))
(defrun train :model gpt :data text :loss (cross-entropy (gpt tokens) next)
  :optimizer (adamw :lr 1e-3 :betas [0.9 0.95] :weight-decay 0.1) :clip 1.0
  :batch 8 :microbatches 2 :steps 8 :dtype "bf16" :seed 7
  :eval (every 4 :batches 2) :checkpoint (every 4 "checkpoints"))
"""


def _env(tmp_path: Path) -> dict[str, str]:
    if not _gpu():
        pytest.skip("no GPU")
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {
        **os.environ,
        "PYTHONPATH": path,
        "SEXPGPU_DEVICE": "cuda",
        "SEXPGPU_DETERMINISTIC": "1",
        "XDG_CACHE_HOME": str(tmp_path / "cache"),  # no stacking remembered from elsewhere
    }


def _gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _run(path: Path, out: Path, env: dict[str, str], *extra: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "sexpgpu", "run", str(path), "--out", str(out), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def _bits(run_dir: Path) -> tuple[dict, dict, dict[str, bytes]]:
    final = run_dir / "checkpoints" / "step-8"
    tensors = {p.name: p.read_bytes() for p in sorted(final.glob("*.safetensors"))}
    assert tensors, f"no checkpoint tensors in {final}"
    return read_series(run_dir, "train/loss"), read_series(run_dir, "eval/loss"), tensors


def test_two_runs_and_a_killed_one_resumed_give_the_same_bits(tmp_path: Path) -> None:
    env = _env(tmp_path)
    path = tmp_path / "gpt.lisp"
    path.write_text(GPT)
    log = _run(path, tmp_path / "a", env)
    assert "determinism: on (SEXPGPU_DETERMINISTIC)" in log
    _run(path, tmp_path / "b", env)
    first, second = _bits(tmp_path / "a"), _bits(tmp_path / "b")
    assert len(first[0]) == 8
    assert first == second  # losses, eval losses and checkpoint bytes, bit for bit

    killed = tmp_path / "killed"
    kill_at_step(6, "sexpgpu", "run", str(path), "--out", str(killed), workdir=tmp_path, env=env)
    assert (killed / "checkpoints" / "step-4").is_dir()
    _run(path, killed, env, "--resume", "latest")
    assert _bits(killed) == first
