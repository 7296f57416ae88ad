;; expect:
;; error[E-SHAPE-003]: matmul: inner dimensions differ, 32 and 10 ([4 32] by [10 32])
;;   --> matmul-transpose.lisp:15:5
;;    |
;; 15 |     (matmul h w-out)))
;;    |     ^
;;    = hint: w-out is [10 32]; did you mean (transpose w-out)?
(defparams (width 32) (classes 10))
(defdata d (digits))

; w-out is written [classes width]: it needs a transpose.
(defmodel m (x)
  (let [h (linear x width)
        w-out (param [classes width] :init xavier)]
    (matmul h w-out)))

(defrun r :model m :data d :loss (cross-entropy (m x) y) :optimizer (sgd :lr 0.1) :batch 4 :steps 1)
