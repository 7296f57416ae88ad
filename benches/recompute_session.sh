#!/usr/bin/env bash
# One call on a lent GPU machine: recomputation chosen by the memory plan, on the GPU.
# Logs under $OUT. Run from the repository root:
#   bash benches/recompute_session.sh [tests|plan|run|bench]...   (default: tests plan run)
#  tests: a bf16 smoke GPT that recomputes trains within bf16 tolerance of one that does not;
#  plan:  GPT-2 small (examples/gpt.lisp) planned into 3 GiB: the recompute line and the plan;
#  run:   20 steps of it at 3 GiB (peak against plan, tokens/s) and 20 without a budget;
#  bench: benches/memory_cuda.py (SIZES="16x2048 32x3072" to pick; long: one size per call);
#  card:  the same on a 40 GiB card (SIZES, default 14x4096; SIDES, default both;
#         FLOPS_SIZES, where to plan at 60% of the no-recompute plan, none for nowhere);
#  oom:   one sexpgpu size on that card (SIZE, default 14x4096) under dev/oom_where.py: the
#         live blocks by pool and allocating line at its first out-of-memory.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/sexpgpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for part in ${*:-tests plan run}; do
  case $part in
  tests)
    timeout 600 python3 -m pytest -q -m gpu -p no:cacheprovider tests/devices/test_memory_fit.py \
      > "$OUT/recompute_tests.log" 2>&1; tail -5 "$OUT/recompute_tests.log" ;;
  plan)
    SEXPGPU_MEMORY=3GiB python3 -m sexpgpu explain examples/gpt.lisp --device cuda 2>&1 \
      | grep '^; \(memory\|recompute\|stacking\)' | tee "$OUT/recompute_explain.log" ;;
  run)
    for budget in 3GiB none; do
      env $([ $budget != none ] && echo SEXPGPU_MEMORY=$budget) SEXPGPU_DEVICE=cuda \
        python3 -m sexpgpu run examples/gpt.lisp --steps 20 --out /tmp/recompute-$budget \
        > "$OUT/recompute_run_$budget.log" 2>&1
      grep -E 'recompute:|memory: (plan|peak)|stacking' "$OUT/recompute_run_$budget.log"
      cat /tmp/recompute-$budget/status.json 2>/dev/null; echo
    done ;;
  bench)
    python3 benches/memory_cuda.py ${SIZES:+--sizes $SIZES} 2>&1 | tee "$OUT/memory_cuda.log" ;;
  card)
    timeout ${CARD_TIMEOUT:-580} python3 benches/memory_cuda.py --card 40 --sizes ${SIZES:-14x4096} \
      --sides ${SIDES:-sexpgpu torch} --logs "$OUT/card" --timeout 400 \
      --flops-sizes ${FLOPS_SIZES:-16x2048 13x4096@16} 2>&1 | tee "$OUT/memory_card.log" ;;
  oom)
    timeout 580 python3 dev/oom_where.py "$OUT/oom.txt" benches/memory_cuda.py --side=sexpgpu \
      --size=${SIZE:-14x4096} --seq=2048 --batch=8 --steps=10 --warmup=3 --card=40 \
      > "$OUT/oom.log" 2>&1
    grep -E "^(memory|recompute)|CUDA graph|E-MEM" "$OUT/oom.log" | cut -c1-300; head -30 "$OUT/oom.txt" ;;
  esac
done
