;; ok
;; param ff = 256
;; param head-dim = 16
;; param ratio = 0.25
;; param half = 2
;; param rest = 1
;; param small = 3
;; param big = 64
;; param cube = 64
;; param neg = -64
;; param name = "gpt"
;; param flag = true
(defparams
  (width 64) (heads 4)
  (ff (* 4 width))
  (head-dim (// width heads))
  (ratio (/ 1 heads))
  (half (// 5 2)) (rest (% 5 2))
  (small (min 3 width 7)) (big (max 3 width))
  (cube (pow heads 3))
  (neg (- width))
  (name "gpt") (flag true))
