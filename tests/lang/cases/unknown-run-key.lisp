;; expect:
;; error[E-FORM-003]: unknown key `:step` in run `train`
;;   --> unknown-run-key.lisp:17:3
;;    |
;; 17 |   :step 100)
;;    |   ^
;;    = hint: did you mean `:steps`? keys: :batch, :checkpoint, :clip, :data, :diagnostics, :dtype, :eval, :log, :loss, :microbatches, :model, :optimizer, :schedule, :seed, :steps
(defparams (batch 8))
(defdata digits (digits))
(defmodel mlp (x) (linear x 10))
(defrun train
  :model mlp
  :data digits
  :loss (cross-entropy (mlp x) y)
  :optimizer (sgd :lr 0.1)
  :batch batch
  :step 100)
