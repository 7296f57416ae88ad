;; params:
;; lm/embed/weight [256 32]
;; lm/rmsnorm/weight [32]
;; lm/head [32 256]
(defparams (width 32))
(defdata text (bytes "corpus.txt") :seq 8)
(defmodel lm (tokens)
  (let [h (-> (embed tokens 256 width) silu rmsnorm)
        head (param [width 256] :init (uniform -0.1 0.1))]
    (matmul h head)))
(defrun r :model lm :data text :loss (cross-entropy (lm tokens) next) :optimizer (sgd :lr 0.1) :batch 2 :steps 1)
