"""The small digits MLP experiment the run tests train, with its sizes as arguments."""

_TEXT = """
(defparams (hidden {hidden}) (steps {steps}) (microbatches 2))
(defdata digits (digits) :split 0.9)
(defmodel mlp (x) (-> x (linear hidden) tanh (linear 10)))
(defrun train
  :model mlp
  :data digits
  :loss (cross-entropy (mlp x) y)
  :optimizer (adamw :lr 1e-2 :betas [0.9 0.95] :weight-decay 0.1)
  :schedule (cosine :warmup 3 :floor 0.1)
  :clip 0.5
  :batch 16
  :microbatches microbatches
  :steps steps
  :seed 3
  :checkpoint (every {every} "checkpoints"))
"""


def mlp_text(hidden: int = 32, steps: int = 10, every: int = 5) -> str:
    """The experiment's text: `hidden` units, `steps` steps, a checkpoint `every` steps."""
    return _TEXT.format(hidden=hidden, steps=steps, every=every)
