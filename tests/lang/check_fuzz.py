"""A seeded generator of mutated experiment files, for `sexpgpu check`.

Each file is a small valid experiment (the examples and test cases, made
small) with a few random mutations of its tokens: numbers replaced by
extreme values, names swapped for vocabulary words and keywords, items
repeated or dropped, brackets added or removed. Whatever comes out, `check`
must answer in bounded time with a report or a `SexpgpuError`.
"""

from __future__ import annotations

import random
import re

__all__ = ["SEEDS", "mutate"]

SEEDS = [
    """(defparams (hidden 16) (classes 10) (batch 8) (steps 3) (lr 1e-2))
(defdata digits (digits) :split 0.8)
(defmodel mlp (x) (-> x (linear hidden) relu (linear classes)))
(defrun train :model mlp :data digits :loss (cross-entropy (mlp x) y)
  :optimizer (adamw :lr lr :weight-decay 1e-4) :batch batch :steps steps :seed 0
  :eval (every 2 :batches 1))
""",
    """(defparams (layers 2) (width 16) (heads 2) (seq 8) (vocab 256) (batch 2))
(defvariant smoke (layers 1) (width 8))
(defdata text (python-stdlib) :seq seq :split 0.9)
(defn block (x)
  (let [x (+ x (attention (layernorm x) :heads heads :causal true))]
    (+ x (-> x layernorm (linear (* 4 width)) gelu (linear width)))))
(defmodel gpt (tokens)
  (let [wte (param [vocab width] :init (normal 0.02))]
    (-> (+ (take wte tokens) (embed (positions tokens) seq width))
        (repeat layers block)
        rmsnorm
        (matmul (transpose wte)))))
(defrun train :model gpt :data text :loss (cross-entropy (gpt tokens) next)
  :optimizer (adamw :lr 6e-4 :betas [0.9 0.95] :weight-decay 0.1)
  :schedule (cosine :warmup 1 :floor 0.1) :clip 1.0 :batch batch :microbatches 2
  :steps 3 :dtype bf16 :seed 1 :checkpoint (every 2 "ck")
  :diagnostics ((grad-norm :every 1) (activation-rms :every 1 :reduce max)))
""",
    """(defparams (n 6) (k 3))
(defdata d (digits))
(defn f (x) (-> x (linear n) silu (slice :axis -1 :from 0 :to k)))
(defmodel m (x)
  (let [h (f x) s (softmax (reshape (concat h h :axis 1) [-1 2 k]) :axis 2)]
    (mse (sum s :axis 1) (exp (log (sqrt (abs (amax s :axis 1 :keep false))))))))
(defrun r :model m :data d :loss (m x) :optimizer (sgd :lr 0.1 :momentum 0.9)
  :batch 4 :steps 1 :schedule (linear :warmup 1 :floor 0.0))
""",
]

_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[()\[\]]|[^\s()\[\]]+')
_NUMBER = re.compile(r"[-+]?[0-9][0-9.e+-]*")
_NUMBERS = [
    "0", "-1", "1", "2", "-0.0", "1e300", "-1e300", "1e-300", "0.5", "65536", "1000000000",
    "2147483647", "4611686018427387904", "9223372036854775807", "-9223372036854775807",
    "3.0", "1e18", "100000",
]  # fmt: skip
_WORDS = [
    "x", "y", "tokens", "next", "relu", "gelu", "silu", "linear", "repeat", "let", "->",
    "param", "layers", "width", "seq", "batch", "f", "block", "m", "mse", "cross-entropy",
    "attention", "positions", "reshape", "transpose", "sum", "pow", "*", "/", "//", "%",
    ":axis", ":heads", ":seq", ":batch", ":dtype", "bf16", "true", "false", '"s"', "[]", "()",
    "(repeat x 1000000000 relu)", "(pow 2 62)", "(* 4 width)", "[4 -1]", ":steps",
]  # fmt: skip


def mutate(seed_text: str, rng: random.Random, count: int | None = None) -> str:
    """`seed_text` with `count` (default 1 to 4) random token mutations."""
    tokens = _TOKEN.findall(seed_text)
    for _ in range(count or rng.randint(1, 4)):
        numbers = [i for i, t in enumerate(tokens) if _NUMBER.fullmatch(t)] or [0]
        i = rng.randrange(len(tokens))
        kind = rng.random()
        if kind < 0.4:  # a size, rate or count made extreme: the file often stays valid
            tokens[rng.choice(numbers)] = rng.choice(_NUMBERS)
        elif kind < 0.5:
            tokens[i] = rng.choice(_NUMBERS)
        elif kind < 0.65:
            tokens[i] = rng.choice(_WORDS)
        elif kind < 0.8:
            tokens.insert(i, tokens[rng.randrange(len(tokens))])
        elif kind < 0.9:
            del tokens[i]
        else:
            tokens.insert(i, rng.choice("()[]"))
    return " ".join(tokens) + "\n"
