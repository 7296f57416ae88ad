;; expect:
;; error[E-TRACE-004]: attention: 3 key/value heads do not divide 4 query heads
;;   --> kv-heads-do-not-divide.lisp:11:74
;;    |
;; 11 |   (-> x (linear 32) (reshape [4 1 32]) (attention :heads heads :kv-heads 3) (reshape [4 32]) (linear 10)))
;;    |                                                                          ^
;;    = hint: choose :kv-heads dividing 4 (1 for multi-query attention)
(defparams (heads 4))
(defdata d (digits))
(defmodel m (x)
  (-> x (linear 32) (reshape [4 1 32]) (attention :heads heads :kv-heads 3) (reshape [4 32]) (linear 10)))
(defrun r :model m :data d :loss (cross-entropy (m x) y) :optimizer (sgd :lr 0.1) :batch 4 :steps 1)
