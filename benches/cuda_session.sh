#!/usr/bin/env bash
# One call on a lent GPU machine: the gpu tests, the smoke run against the cpu
# device, and the benchmarks; logs under $OUT. Run from the repository root:
#   bash benches/cuda_session.sh [tests|smoke|bench|profile|tn|dp]...   (default: tests smoke bench tn)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/sexpgpu-out}
mkdir -p "$OUT"
. benches/wheels.sh  # carried test dependencies
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
parts=${*:-tests smoke bench tn}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys, torch, numpy; print(sys.version.split()[0], torch.__version__, torch.version.cuda, numpy.__version__, torch.backends.cudnn.version())"

for part in $parts; do
  case $part in
  tests)
    timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider ${TEST_PATHS:-tests/devices tests/runtime tests/train} \
      > "$OUT/gpu_tests.log" 2>&1; tail -25 "$OUT/gpu_tests.log" ;;
  smoke)
    # The check: cuda gives the cpu run's losses to bf16 tolerance.
    python3 -m sexpgpu run examples/gpt.lisp --variant smoke --steps 200 --out /tmp/smoke-cpu \
      > "$OUT/smoke_cpu.log" 2>&1
    SEXPGPU_DEVICE=cuda python3 -m sexpgpu run examples/gpt.lisp --variant smoke --steps 200 \
      --out /tmp/smoke-cuda 2>&1 | tee "$OUT/smoke_cuda.log" | grep -v '^step' | head -60
    python3 benches/compare_runs.py /tmp/smoke-cpu /tmp/smoke-cuda 2>&1 | tee "$OUT/smoke_compare.log" ;;
  bench)
    timeout ${BENCH_TIMEOUT:-590} python3 benches/gpt2_cuda.py ${BENCH_ARGS:-} > "$OUT/bench_gpt2.log" 2>&1
    tail -14 "$OUT/bench_gpt2.log" ;;
  examples)
    # The memory plan against the peak on every example, at full size.
    for ex in mlp gpt; do
      SEXPGPU_DEVICE=cuda timeout 150 python3 -m sexpgpu run examples/$ex.lisp --steps 30 --out /tmp/ex-$ex \
        > "$OUT/example_$ex.log" 2>&1
      grep -E "^(stacking|fused:|memory:)|tok/s" "$OUT/example_$ex.log" | grep -v "^kernel" | tail -6
    done ;;
  profile)
    for side in ${PROFILE_SIDES:-sexpgpu reduce-overhead}; do
      timeout 200 python3 dev/gpt_profile.py --side $side > "$OUT/profile_$side.log" 2>&1
      head -16 "$OUT/profile_$side.log"
    done ;;
  tn)
    if [ -f benches/tn_gpu.py ]; then
      # The GPU tests live in one module (the others need h5py, zarr and quimb).
      timeout ${TN_TEST_TIMEOUT:-200} python3 -m pytest -q -m gpu -p no:cacheprovider tests/tn/test_tn_devices.py \
        tests/tn/test_tn_passes.py tests/tn/test_tn_cholqr.py tests/tn/test_tn_thin.py > "$OUT/tn_gpu_tests.log" 2>&1
      tail -5 "$OUT/tn_gpu_tests.log"
      timeout ${TN_PROFILE_TIMEOUT:-100} python3 dev/tn_profile.py --chi 1000 ${TN_PROFILE:---parts qr} \
        > "$OUT/tn_profile.log" 2>&1; tail -40 "$OUT/tn_profile.log"
      timeout ${TN_TIMEOUT:-300} python3 benches/tn_gpu.py ${TN_ARGS:---sites 20 40 --chi 500 --reps 2 --gpu-memory 600MiB} \
        > "$OUT/tn_gpu_bench.log" 2>&1; tail -30 "$OUT/tn_gpu_bench.log"
    fi ;;
  dp)
    # Data parallel on the one GPU: SEXPGPU_DEVICES=0 is the single-GPU run, and two
    # node processes sharing the GPU (over loopback) train like one process of two ranks.
    sed 's/(microbatches 1)/(microbatches 2)/' examples/gpt.lisp > /tmp/gpt-mb2.lisp
    run() { python3 -m sexpgpu run /tmp/gpt-mb2.lisp --variant smoke --steps 40 "$@"; }
    SEXPGPU_DEVICE=cuda run --out /tmp/dp-plain > "$OUT/dp_plain.log" 2>&1
    SEXPGPU_DEVICE=cuda SEXPGPU_DEVICES=0 run --out /tmp/dp-one > "$OUT/dp_one.log" 2>&1
    for r in 1 0; do
      SEXPGPU_DEVICE=cuda SEXPGPU_NODES=2 SEXPGPU_NODE_RANK=$r SEXPGPU_RENDEZVOUS=127.0.0.1:29561 \
        SEXPGPU_NODE_GRADIENTS=f32 SEXPGPU_NODE_TIMEOUT=120 run --out /tmp/dp-node$r \
        > "$OUT/dp_node$r.log" 2>&1 &
    done
    wait
    tail -n 3 "$OUT/dp_node0.log" "$OUT/dp_node1.log"
    python3 benches/compare_runs.py /tmp/dp-plain /tmp/dp-one --rtol 0 2>&1 | tee "$OUT/dp_compare.log"
    python3 benches/compare_runs.py /tmp/dp-plain /tmp/dp-node0 --rtol 1e-5 2>&1 | tee -a "$OUT/dp_compare.log"
    grep -h '"train/loss"' /tmp/dp-plain/metrics.jsonl | head -5 ;;
  probe)
    timeout 200 python3 dev/tn_gpu_probe.py 2>&1 | tee "$OUT/probe.log" ;;
  esac
done
