#!/usr/bin/env bash
# One call on a lent GPU machine: recomputation chosen by the memory plan, on the GPU.
# Logs under $OUT. Run from the repository root:  bash benches/recompute_session.sh
#  1. the gpu test: a bf16 smoke GPT that recomputes trains within bf16 tolerance of one that does not;
#  2. GPT-2 small (examples/gpt.lisp) planned into 12 GiB: the recompute line and the plan;
#  3. 20 steps of it at 12 GiB: the measured peak against the plan, tokens/s, and the same
#     20 steps without a budget for the loss and tokens/s it is compared with.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/sexpgpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 600 python3 -m pytest -q -m gpu -p no:cacheprovider tests/devices/test_memory_fit.py \
  > "$OUT/recompute_tests.log" 2>&1; tail -5 "$OUT/recompute_tests.log"
SEXPGPU_MEMORY=12GiB python3 -m sexpgpu explain examples/gpt.lisp --device cuda 2>&1 \
  | grep '^; \(memory\|recompute\|stacking\)' | tee "$OUT/recompute_explain.log"
for budget in 12GiB none; do
  env $([ $budget != none ] && echo SEXPGPU_MEMORY=$budget) SEXPGPU_DEVICE=cuda \
    python3 -m sexpgpu run examples/gpt.lisp --steps 20 --out /tmp/recompute-$budget \
    > "$OUT/recompute_run_$budget.log" 2>&1
  grep -E 'recompute:|memory: (plan|peak)|stacking' "$OUT/recompute_run_$budget.log"
  tail -3 /tmp/recompute-$budget/status.json 2>/dev/null; echo
done
