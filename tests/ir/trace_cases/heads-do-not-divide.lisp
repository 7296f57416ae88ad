;; expect:
;; error[E-TRACE-004]: attention: width 30 does not split into 4 heads
;;   --> heads-do-not-divide.lisp:11:39
;;    |
;; 11 |   (-> x (linear 30) (attention :heads heads) (linear 10)))
;;    |                                       ^
;;    = hint: choose :heads dividing 30
(defparams (heads 4))
(defdata d (digits))
(defmodel m (x)
  (-> x (linear 30) (attention :heads heads) (linear 10)))
(defrun r :model m :data d :loss (cross-entropy (m x) y) :optimizer (sgd :lr 0.1) :batch 4 :steps 1)
