;; ok
;; variant: tiny
;; param width = 16
;; param ff = 64
;; param lr = 0.0005
;; param layers = 2
(defparams (layers 2) (width 128) (ff (* 4 width)) (lr 2e-3))

; a variant's value may use earlier parameters, and its own default
(defvariant tiny (width (// 128 8)) (lr (/ lr 4)))
