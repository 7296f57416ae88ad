;; expect:
;; error[E-TRACE-004]: where: the mask is a f32 tensor [4 64], not a bool mask
;;   --> where-mask.lisp:10:14
;;    |
;; 10 |   (-> (where x x 0.0) (linear 10)))
;;    |              ^
;;    = hint: make it with a comparison, e.g. (where (< x 0) a b)
(defdata d (digits))
(defmodel m (x)
  (-> (where x x 0.0) (linear 10)))
(defrun r :model m :data d :loss (cross-entropy (m x) y) :optimizer (sgd :lr 0.1) :batch 4 :steps 1)
