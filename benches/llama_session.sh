#!/usr/bin/env bash
# One call on a lent GPU machine for the Llama-family work: its gpu tests, the
# example on cuda against the cpu device (with and without dropout), and the
# benchmarks against torch.compile; logs under $OUT. Each part fits one call
# of at most 10 minutes (eager is left out of the benchmarks by default: it has no
# target, and a call holds three sides). Run from the repository root, a part a call:
#   bash benches/llama_session.sh tests smoke ; bash benches/llama_session.sh bench124 ;
#   bash benches/llama_session.sh benchtiny          (SIDES="..." picks the sides)
#   bash benches/llama_session.sh floor profiletiny  (where TinyLlama's step goes, against its floor)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/sexpgpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
parts=${*:-tests smoke}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

for part in $parts; do
  case $part in
  tests)
    # The new ops and the Llama example's training graph on CUDA against the
    # interpreter (dropout's masks drawn by the lowering included), and the
    # attention backends with grouped key/value heads.
    timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests/devices/test_cuda_lowering.py \
      -k "llama or uniform or sin or cos or attention" > "$OUT/llama_gpu_tests.log" 2>&1
    tail -8 "$OUT/llama_gpu_tests.log" ;;
  smoke)
    # The example on cuda (fused, CUDA graphs, stacking) gives the cpu run's losses,
    # with dropout too: the masks are the interpreter's.
    sed 's/(dropout 0.0)/(dropout 0.1)/' examples/llama.lisp > /tmp/llama-dropout.lisp
    for ex in examples/llama.lisp /tmp/llama-dropout.lisp; do
      name=$(basename "$ex" .lisp)
      python3 -m sexpgpu run "$ex" --variant smoke --steps 60 --out "/tmp/$name-cpu" > "$OUT/${name}_cpu.log" 2>&1
      SEXPGPU_DEVICE=cuda python3 -m sexpgpu run "$ex" --variant smoke --steps 60 --out "/tmp/$name-cuda" \
        > "$OUT/${name}_cuda.log" 2>&1
      grep -E "^(stacking|fused:|memory:|attention)" "$OUT/${name}_cuda.log" | head -8
      python3 benches/compare_runs.py "/tmp/$name-cpu" "/tmp/$name-cuda" --rtol 1e-3 2>&1 | tee -a "$OUT/llama_compare.log"
    done ;;
  bench124)
    timeout 590 python3 benches/llama_cuda.py --shapes 124m --timeout 200 \
      --sides ${SIDES:-sexpgpu sexpgpu-products compile reduce-overhead} > "$OUT/bench_llama_124m.log" 2>&1
    tail -12 "$OUT/bench_llama_124m.log" ;;
  benchtiny)
    timeout 590 python3 benches/llama_cuda.py --shapes tinyllama --timeout 190 \
      --sides ${SIDES:-sexpgpu compile reduce-overhead} > "$OUT/bench_llama_tiny.log" 2>&1
    tail -10 "$OUT/bench_llama_tiny.log" ;;
  floor)
    # Each product and attention call of the step alone at its best, and the update's least
    # traffic (dev/step_floor.py), beside the step benchtiny and bench124 measure.
    # The peers' steps: torch.compile's 67,642 and 549,888 tokens/s (benches/README.md),
    # llm.c's 529k on GPT-2 small at batch 16.
    for shape in "tinyllama 8 242.2" "124m 32 59.6" "gpt2 16 30.97"; do
      set -- $shape
      timeout 150 python3 dev/step_floor.py --bench "$1" --batch "$2" --reps 8 --peer-ms "$3" \
        > "$OUT/floor_$1.log" 2>&1
      tail -22 "$OUT/floor_$1.log"
    done ;;
  profiletiny)
    for side in ${SIDES:-sexpgpu reduce-overhead}; do
      timeout 240 python3 dev/gpt_profile.py --model tinyllama --batch 8 --side "$side" \
        > "$OUT/profile_tiny_$side.log" 2>&1
      head -40 "$OUT/profile_tiny_$side.log"
    done ;;
  esac
done
