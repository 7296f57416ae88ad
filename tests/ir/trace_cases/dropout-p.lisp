;; expect:
;; error[E-TRACE-004]: dropout: `:p` must lie in [0, 1), found 1
;;   --> dropout-p.lisp:10:33
;;    |
;; 10 |   (-> x (linear 32) (dropout :p 1.0) (linear 10)))
;;    |                                 ^
;;    = hint: write e.g. :p 0.1
(defdata d (digits))
(defmodel m (x)
  (-> x (linear 32) (dropout :p 1.0) (linear 10)))
(defrun r :model m :data d :loss (cross-entropy (m x) y) :optimizer (sgd :lr 0.1) :batch 4 :steps 1)
