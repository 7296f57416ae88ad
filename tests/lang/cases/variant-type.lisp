;; variant: half
;; expect:
;; error[E-FORM-005]: `width` is an integer (64 without the variant), but the variant gives a float 32.0
;;   --> variant-type.lisp:12:25
;;    |
;; 12 | (defvariant half (width (/ width 2)) (lr 1))
;;    |                         ^
;;    = hint: give `width` an integer
(defparams (width 64) (lr 1e-3))

; `/` always gives a float: halve an integer with `//`
(defvariant half (width (/ width 2)) (lr 1))
