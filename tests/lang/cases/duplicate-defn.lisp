;; expect:
;; error[E-FORM-004]: duplicate definition of `block`
;;   --> duplicate-defn.lisp:12:7
;;    |
;; 12 | (defn block (x) (relu x))
;;    |       ^
;;    = hint: `block` is already defined as a function at 10:7; rename one of them
(defparams (width 8))

(defn block (x) (linear x width))

(defn block (x) (relu x))
