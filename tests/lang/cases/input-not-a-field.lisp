;; expect:
;; error[E-FORM-006]: model `lm` takes `text`, which data `text` does not yield
;;   --> input-not-a-field.lisp:11:10
;;    |
;; 11 |   :model lm
;;    |          ^
;;    = hint: data `text` yields tokens, next; name the model's inputs after them
(defdata text (python-stdlib) :seq 64)
(defmodel lm (text) (linear text 256))
(defrun train
  :model lm
  :data text
  :loss (cross-entropy (lm tokens) next)
  :optimizer (adamw :lr 1e-3)
  :batch 8
  :steps 10)
