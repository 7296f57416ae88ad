#!/usr/bin/env bash
# Runs you can trust, on one lent GPU: the gpu tests, cuda determinism (two runs and a
# SIGKILL + --resume latest, compared bit for bit), the memory lie (SEXPGPU_MEMORY above
# the card: a split or E-MEM-002, never an internal error), and GPT-2 small at batch 16
# with determinism off and on. Logs under $OUT. From the repository root:
#   bash benches/gpu_trust.sh [tests|determinism|detest|trace|oom|bench]...   (default: all but detest, trace)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/sexpgpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export XDG_CACHE_HOME=/tmp/trust-cache  # no stacking remembered from other runs
parts=${*:-tests determinism oom bench}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
# `timeout` runs programs, not shell functions: the command is a word list.
run=(env SEXPGPU_DEVICE=cuda python3 -m sexpgpu run)

for part in $parts; do
  echo "== $part"
  case $part in
  tests)
    timeout ${TEST_TIMEOUT:-900} python3 -m pytest -m gpu -q -p no:cacheprovider tests \
      > "$OUT/gpu_tests.log" 2>&1; tail -25 "$OUT/gpu_tests.log" ;;
  trace)  # where runs part: each step's gradients of runs of the test's GPT, compared.
    # TRACE_PROBES takes one suspect away per entry (dev/step_trace.py): none, graphs (no
    # CUDA graphs), fill (NaN in memory never written), mb1 (one microbatch), noeval.
    TRACE_STEPS=${TRACE_STEPS:-12} python3 - <<'PY' > /tmp/trace.lisp
import os, re
text = open("tests/devices/test_cuda_determinism.py").read()
steps = os.environ["TRACE_STEPS"]
print(re.search(r'GPT = """(.*?)"""', text, re.S).group(1).replace(":steps 8", f":steps {steps}"))
PY
    sed 's/:microbatches 2/:microbatches 1/' /tmp/trace.lisp > /tmp/trace-mb1.lisp
    sed -e 's/ :eval (every 4 :batches 2) :checkpoint (every 4 "checkpoints")//' /tmp/trace.lisp > /tmp/trace-noeval.lisp
    for probe in ${TRACE_PROBES:-none}; do
      file=/tmp/trace.lisp; probe_env=()
      case $probe in
        graphs) probe_env=(STEP_TRACE_GRAPHS=0) ;;
        fill) probe_env=(STEP_TRACE_FILL=1) ;;
        mb1|noeval) file=/tmp/trace-$probe.lisp ;;
      esac
      rm -rf /tmp/trace-$probe-*
      for r in ${TRACE_RUNS:-a b c}; do
        env "${probe_env[@]}" SEXPGPU_DETERMINISTIC=1 SEXPGPU_DEVICE=${TRACE_DEVICE:-cuda} timeout 200 python3 dev/step_trace.py \
          record /tmp/trace-$probe-$r.npz -- run $file --out /tmp/trace-$probe-$r > "$OUT/trace_${probe}_$r.log" 2>&1 \
          || echo "trace $probe $r: exit $?"
      done
      echo "-- probe $probe"
      python3 dev/step_trace.py compare /tmp/trace-$probe-*.npz | tee "$OUT/trace_$probe.log"
    done ;;
  detest)  # the determinism test alone (a small bf16 GPT)
    timeout ${DETEST_TIMEOUT:-300} python3 -m pytest -m gpu -q -p no:cacheprovider tests/devices/test_scatter_rows_kernel.py tests/devices/test_readback_barrier.py tests/devices/test_cuda_determinism.py \
      > "$OUT/determinism_test.log" 2>&1; tail -15 "$OUT/determinism_test.log" ;;
  determinism)
    # examples/gpt.lisp at full size (bf16, 8 microbatches a step), cut to DET_STEPS steps.
    steps=${DET_STEPS:-40}; half=$((steps / 2))
    sed -e "s/(steps 5000)/(steps $steps)/" -e "s/(checkpoint-every 1000)/(checkpoint-every $half)/" \
      -e "s/(eval-every 250)/(eval-every $half)/" examples/gpt.lisp > /tmp/gpt-det.lisp
    rm -rf /tmp/det-*
    for mode in 1 0; do
      for name in a b; do
        SEXPGPU_DETERMINISTIC=$mode timeout 300 "${run[@]}" /tmp/gpt-det.lisp --out /tmp/det-$mode-$name \
          > "$OUT/det_${mode}_$name.log" 2>&1 || echo "det $mode $name: exit $?"
      done
      grep -h "determinism:" "$OUT/det_${mode}_a.log" | head -1
      echo "SEXPGPU_DETERMINISTIC=$mode, two runs:"
      python3 benches/compare_runs.py /tmp/det-$mode-a /tmp/det-$mode-b --rtol 0
    done
    # Killed with SIGKILL once step 3/4 of the steps is logged, then resumed from the checkpoint.
    SEXPGPU_DETERMINISTIC=1 SEXPGPU_DEVICE=cuda python3 -m sexpgpu run /tmp/gpt-det.lisp \
      --out /tmp/det-killed > "$OUT/det_killed.log" 2>&1 &
    pid=$!
    at=$((3 * steps / 4))
    for _ in $(seq 300); do
      python3 -c "import sys; from sexpgpu.train.metrics import read_series as r
sys.exit($at not in r('/tmp/det-killed', 'train/loss'))" 2>/dev/null && break
      kill -0 $pid 2>/dev/null || break
      sleep 1
    done
    kill -9 $pid; wait $pid 2>/dev/null
    SEXPGPU_DETERMINISTIC=1 timeout 300 "${run[@]}" /tmp/gpt-det.lisp --out /tmp/det-killed --resume latest \
      > "$OUT/det_resumed.log" 2>&1 || echo "resume: exit $?"
    grep -h "resumed" "$OUT/det_resumed.log" | head -2
    echo "killed + --resume latest against the uninterrupted run:"
    python3 benches/compare_runs.py /tmp/det-1-a /tmp/det-killed --rtol 0
    for f in params.safetensors optimizer.safetensors; do
      cmp /tmp/det-1-a/checkpoints/step-$steps/$f /tmp/det-1-b/checkpoints/step-$steps/$f && \
        cmp /tmp/det-1-a/checkpoints/step-$steps/$f /tmp/det-killed/checkpoints/step-$steps/$f && \
        echo "$f: the same bytes in all three"
    done ;;
  oom)
    # The lie: a plan for more memory than the card has passes, then allocations fail.
    sed -e "s/(batch 8) (microbatches 8) (steps 5000)/(batch ${OOM_BATCH:-512}) (microbatches 1) (steps 2)/" \
      examples/gpt.lisp > /tmp/gpt-oom.lisp
    SEXPGPU_MEMORY=${OOM_MEMORY:-1TiB} timeout ${OOM_TIMEOUT:-400} "${run[@]}" /tmp/gpt-oom.lisp --out /tmp/oom \
      > "$OUT/oom.log" 2>&1
    code=$?
    grep -E "^memory:|error\[|internal error" "$OUT/oom.log" | head -12
    echo "oom: exit $code (0: the split trained; 1: E-MEM-002; 70 would be an internal error)" ;;
  bench)
    for mode in 0 1; do
      SEXPGPU_DETERMINISTIC=$mode timeout ${BENCH_TIMEOUT:-300} python3 benches/gpt2_cuda.py \
        --batches 16 --sides sexpgpu --steps ${BENCH_STEPS:-12} --warmup 4 > "$OUT/bench_det$mode.log" 2>&1
      echo "SEXPGPU_DETERMINISTIC=$mode:"; tail -6 "$OUT/bench_det$mode.log"
    done ;;
  esac
done
