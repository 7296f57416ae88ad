;; expect:
;; error[E-TRACE-004]: attention: `:rope` needs an even head size, found 1 (width 32 / 32 heads)
;;   --> rope-odd-head.lisp:10:55
;;    |
;; 10 |   (-> x (reshape [4 2 32]) (attention :heads 32 :rope 10000.0) (reshape [4 64]) (linear 10)))
;;    |                                                       ^
;;    = hint: choose :heads so that width / heads is even, or :rope false
(defdata d (digits))
(defmodel m (x)
  (-> x (reshape [4 2 32]) (attention :heads 32 :rope 10000.0) (reshape [4 64]) (linear 10)))
(defrun r :model m :data d :loss (cross-entropy (m x) y) :optimizer (sgd :lr 0.1) :batch 4 :steps 1)
