;; expect:
;; error[E-SHAPE-011]: sdpa: 3 key/value heads do not divide 4 query heads ([4 4 4 4], [4 3 4 4], [4 3 4 4])
;;   --> sdpa-heads.lisp:12:17
;;    |
;; 12 |     (-> (sdpa q k k) (reshape [4 64]) (linear 10))))
;;    |                 ^
;;    = hint: each group of query heads shares one key/value head: K must divide H
(defdata d (digits))
(defmodel m (x)
  (let [q (reshape x [4 4 4 4])
        k (reshape (slice x :to 48) [4 3 4 4])]
    (-> (sdpa q k k) (reshape [4 64]) (linear 10))))
(defrun r :model m :data d :loss (cross-entropy (m x) y) :optimizer (sgd :lr 0.1) :batch 4 :steps 1)
