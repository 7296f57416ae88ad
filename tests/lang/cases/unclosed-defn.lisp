;; expect:
;; error[E-READ-001]: unclosed `(`: the list opened here is never closed
;;  --> unclosed-defn.lisp:8:1
;;   |
;; 8 | (defn block (x)
;;   | ^
;;   = hint: add `)` to close the list that opens at 8:1; the form at 11:1 starts inside it, so the `)` is probably missing before line 11
(defn block (x)
  (relu (linear x 64))

(defmodel mlp (x)
  (block x))
