;; expect:
;; error[E-TRACE-006]: the loss must be a float scalar, found a f32 tensor [4 10]
;;   --> loss-not-reduced.lisp:10:34
;;    |
;; 10 | (defrun r :model m :data d :loss (- (m x) 1) :optimizer (sgd :lr 0.1) :batch 4 :steps 1)
;;    |                                  ^
;;    = hint: reduce it, e.g. (mean ...) or (cross-entropy logits targets)
(defdata d (digits))
(defmodel m (x) (linear x 10))
(defrun r :model m :data d :loss (- (m x) 1) :optimizer (sgd :lr 0.1) :batch 4 :steps 1)
