;; expect:
;; error[E-TRACE-004]: rope needs a [.. seq heads d] tensor with an even d, found [4 2 2 3]
;;   --> rope-odd.lisp:10:30
;;    |
;; 10 |   (-> x (reshape [4 2 2 -1]) (slice :to 3) (rope :base 10000.0) (reshape [4 -1]) (linear 10)))
;;    |                              ^
;;    = hint: split the heads first: (reshape q [batch seq heads d])
(defdata d (digits))
(defmodel m (x)
  (-> x (reshape [4 2 2 -1]) (slice :to 3) (rope :base 10000.0) (reshape [4 -1]) (linear 10)))
(defrun r :model m :data d :loss (cross-entropy (m x) y) :optimizer (sgd :lr 0.1) :batch 4 :steps 1)
