;; params:
;; m/scale [64]
;; m/mix.0/linear/weight [64 64]
;; m/mix.0/linear/bias [64]
;; m/mix.0/layernorm/weight [64]
;; m/mix.0/layernorm/bias [64]
;; m/mix.1/linear/weight [64 64]
;; m/mix.1/linear/bias [64]
;; m/mix.1/layernorm/weight [64]
;; m/mix.1/layernorm/bias [64]
;; m/linear/weight [64 10]
(defparams (classes 10))
(defdata d (digits))
(defn mix (x) (-> x (linear 64) layernorm gelu))
(defmodel m (x)
  (let [scale (param [64] :init ones)]
    (-> (* x scale) (repeat 2 mix) (linear classes :bias false))))
(defrun r :model m :data d :loss (cross-entropy (m x) y) :optimizer (sgd :lr 0.1) :batch 4 :steps 1)
