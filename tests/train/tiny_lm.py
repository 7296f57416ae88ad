"""A tiny byte-level GPT trained for a few steps: what the sample, eval and export tests use."""

from __future__ import annotations

from pathlib import Path

from sexpgpu.cli import main

TEXT = """\
(defparams (layers 2) (width 32) (heads 2) (seq 16) (vocab 256) (batch 4)
  (steps 4) (lr 3e-3) (dtype "f32"))

(defdata text (bytes "text.txt") :seq seq :split 0.8)

(defn block (x)
  (let [x (+ x (attention (layernorm x) :heads heads :causal true))]
    (+ x (-> x layernorm (linear (* 4 width)) gelu (linear width)))))

(defmodel gpt (tokens)
  (let [wte (param [vocab width] :init (normal 0.02))]
    (-> (+ (take wte tokens) (embed (positions tokens) seq width))
        (repeat layers block)
        layernorm
        (matmul (transpose wte)))))

(defrun train
  :model gpt
  :data text
  :loss (cross-entropy (gpt tokens) next)
  :optimizer (adamw :lr lr)
  :batch batch
  :steps steps
  :seed 3
  :eval (every 2 :batches 3)
  :checkpoint (every 2 "checkpoints"))
"""


def write_tiny_lm(folder: Path, text: str = TEXT) -> Path:
    """The experiment file and its data in `folder`; returns the file."""
    folder.mkdir(parents=True, exist_ok=True)
    words = "the quick brown fox jumps over the lazy dog; naïve café, déjà vu. "
    (folder / "text.txt").write_text(words * 40, encoding="utf-8")
    path = folder / "lm.lisp"
    path.write_text(text, encoding="utf-8")
    return path


def train_tiny_lm(folder: Path, *extra: str) -> tuple[Path, Path]:
    """Train it into ``folder/run``; returns (the file, the run folder)."""
    path = write_tiny_lm(folder)
    run_dir = folder / "run"
    assert main(["run", str(path), "--out", str(run_dir), *extra]) == 0
    return path, run_dir
