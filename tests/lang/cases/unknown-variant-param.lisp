;; expect:
;; error[E-FORM-006]: variant `smoke` sets `layer`, which is not a parameter
;;   --> unknown-variant-param.lisp:11:20
;;    |
;; 11 | (defvariant smoke (layer 2) (width 64))
;;    |                    ^
;;    = hint: did you mean `layers`? parameters: layers, width
(defparams (layers 12) (width 768))

; every variant is checked, even when it is not the one chosen
(defvariant smoke (layer 2) (width 64))
