;; expect:
;; error[E-TRACE-001]: unknown function `layer-norm`
;;   --> unknown-layer.lisp:10:9
;;    |
;; 10 |   (-> x layer-norm (linear 10)))
;;    |         ^
;;    = hint: did you mean `layernorm`? defined: m; vocabulary: * + - -> / < <= = > >= abs amax attention cast concat cos cross-entropy dropout embed exp gelu layernorm let linear log log-softmax matmul max mean min mse neg param positions pow relu repeat reshape rmsnorm rope rsqrt sdpa sigmoid silu sin slice softmax sqrt sum take tanh transpose where
(defdata d (digits))
(defmodel m (x)
  (-> x layer-norm (linear 10)))
(defrun r :model m :data d :loss (cross-entropy (m x) y) :optimizer (sgd :lr 0.1) :batch 4 :steps 1)
