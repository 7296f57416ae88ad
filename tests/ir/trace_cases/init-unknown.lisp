;; expect:
;; error[E-TRACE-005]: linear: unknown initializer (gaussian 0.02)
;;   --> init-unknown.lisp:10:22
;;    |
;; 10 |   (linear x 10 :init (gaussian 0.02)))
;;    |                      ^
;;    = hint: initializers: (normal std), (uniform lo hi), zeros, ones, xavier
(defdata d (digits))
(defmodel m (x)
  (linear x 10 :init (gaussian 0.02)))
(defrun r :model m :data d :loss (cross-entropy (m x) y) :optimizer (sgd :lr 0.1) :batch 4 :steps 1)
