; A small classifier of handwritten digits (scikit-learn's 8x8 images):
; 64 pixels -> 128 hidden units (relu) -> 10 classes. Trains in seconds on a CPU.
;
;   sexpgpu check examples/mlp.lisp
;   sexpgpu run examples/mlp.lisp --device cpu

(defparams (hidden 128) (classes 10) (batch 64) (steps 300) (lr 1e-2))

(defdata digits (digits) :split 0.8)

(defmodel mlp (x)
  (-> x (linear hidden) relu (linear classes)))

(defrun train
  :model mlp
  :data digits
  :loss (cross-entropy (mlp x) y)
  :optimizer (adamw :lr lr :weight-decay 1e-4)
  :batch batch
  :steps steps
  :seed 0
  :eval (every 50 :batches 5))
