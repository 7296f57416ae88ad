;; expect:
;; error[E-READ-004]: unknown escape `\c` in a string
;;  --> bad-escape.lisp:8:27
;;   |
;; 8 | (defdata text (bytes "data\corpus.txt") :seq 64)
;;   |                           ^
;;   = hint: the escapes are \" \\ \n and \t; write \\ for a backslash
(defdata text (bytes "data\corpus.txt") :seq 64)
