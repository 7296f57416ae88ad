; A GPT trained on bytes of text: the language's worked example.
;
;   sexpgpu check examples/gpt.lisp --variant smoke
;   sexpgpu run examples/gpt.lisp --variant smoke --steps 3 --device cpu
;
; The data is the standard library of the running Python (real text, on every
; machine, offline); the vocabulary is the 256 byte values.

(defparams
  (layers 12) (width 768) (heads 12) (seq 1024) (vocab 256)
  (batch 8) (microbatches 8) (steps 5000)
  (lr 6e-4) (dtype "bf16")
  (eval-every 250) (checkpoint-every 1000))

; Small enough to train a few hundred steps on a laptop CPU.
(defvariant smoke
  (layers 2) (width 128) (heads 4) (seq 64)
  (microbatches 1) (steps 300)
  (lr 1e-3) (dtype "f32")
  (eval-every 50) (checkpoint-every 100))

(defdata text (python-stdlib) :seq seq :split 0.9)

; One transformer block: attention, then a feed-forward layer, each residual.
(defn block (x)
  (let [x (+ x (attention (layernorm x) :heads heads :causal true))]
    (+ x (-> x layernorm (linear (* 4 width)) gelu (linear width)))))

(defmodel gpt (tokens)
  (let [wte (param [vocab width] :init (normal 0.02))]
    (-> (+ (take wte tokens) (embed (positions tokens) seq width))
        (repeat layers block)
        layernorm
        (matmul (transpose wte)))))

(defrun train
  :model gpt
  :data text
  :loss (cross-entropy (gpt tokens) next)
  :optimizer (adamw :lr lr :betas [0.9 0.95] :weight-decay 0.1)
  :schedule (cosine :warmup 100 :floor 0.1)
  :clip 1.0
  :batch batch
  :microbatches microbatches
  :steps steps
  :dtype dtype
  :seed 1337
  :eval (every eval-every :batches 20)
  :checkpoint (every checkpoint-every "checkpoints")
  :diagnostics ((grad-norm :every 10) (activation-rms :every 100 :reduce max)))
