;; expect:
;; error[E-TRACE-004]: attention: `:rope` must be false or a positive base, found the boolean true
;;   --> attention-rope.lisp:10:54
;;    |
;; 10 |   (-> x (reshape [4 2 32]) (attention :heads 2 :rope true) (reshape [4 64]) (linear 10)))
;;    |                                                      ^
;;    = hint: write :rope 10000.0 (Llama's base) or :rope false
(defdata d (digits))
(defmodel m (x)
  (-> x (reshape [4 2 32]) (attention :heads 2 :rope true) (reshape [4 64]) (linear 10)))
(defrun r :model m :data d :loss (cross-entropy (m x) y) :optimizer (sgd :lr 0.1) :batch 4 :steps 1)
