; A Llama-family model trained on bytes of text: RMSNorm, a SwiGLU feed-forward
; layer, rotary position embeddings, grouped-query attention, no biases, and an
; output head apart from the embedding.
;
;   sexpgpu check examples/llama.lisp --variant smoke
;   sexpgpu run examples/llama.lisp --variant smoke --steps 3 --device cpu
;
; The data is the standard library of the running Python (real text, on every
; machine, offline); the vocabulary is the 256 byte values. Dropout is off as
; in Llama; (dropout 0.1) turns it on after attention and the MLP.

(defparams
  (layers 12) (width 768) (heads 12) (kv-heads 4) (ffn 2048)
  (seq 1024) (vocab 256) (rope-base 10000.0) (dropout 0.0)
  (batch 8) (microbatches 8) (steps 5000)
  (lr 6e-4) (dtype "bf16")
  (eval-every 250) (checkpoint-every 1000))

; Small enough to train a few hundred steps on a laptop CPU.
(defvariant smoke
  (layers 2) (width 128) (heads 4) (kv-heads 2) (ffn 352) (seq 64)
  (microbatches 1) (steps 300)
  (lr 1e-3) (dtype "f32")
  (eval-every 50) (checkpoint-every 100))

(defdata text (python-stdlib) :seq seq :split 0.9)

; Pre-norm block: grouped-query attention with rotary embeddings, then SwiGLU
; (silu(x W1) * x W3) W2; neither has biases.
(defn block (x)
  (let [a (attention (rmsnorm x) :heads heads :kv-heads kv-heads :bias false
                     :rope rope-base :causal true)
        x (+ x (dropout a :p dropout))
        h (rmsnorm x)
        gate (silu (linear h ffn :bias false :init (normal 0.02)))
        up (linear h ffn :bias false :init (normal 0.02))
        down (linear (* gate up) width :bias false :init (normal 0.02))]
    (+ x (dropout down :p dropout))))

(defmodel llama (tokens)
  (-> (embed tokens vocab width :init (normal 0.02))
      (repeat layers block)
      rmsnorm
      (linear vocab :bias false :init (normal 0.02))))

(defrun train
  :model llama
  :data text
  :loss (cross-entropy (llama tokens) next)
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
