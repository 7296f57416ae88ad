#!/usr/bin/env bash
# One call on a lent GPU machine: the gpu tests, the smoke run against the cpu
# device, and the benchmarks; logs under $OUT. Run from the repository root:
#   bash benches/cuda_session.sh [tests|smoke|bench|tn]...   (default: all)
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/sexpgpu-out}
mkdir -p "$OUT"
if [ -d .whl ]; then  # pure-Python test dependencies the machine may lack
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
parts=${*:-tests smoke bench tn}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys, torch, numpy; print(sys.version.split()[0], torch.__version__, torch.version.cuda, numpy.__version__, torch.backends.cudnn.version())"

for part in $parts; do
  case $part in
  tests)
    timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/devices tests/runtime \
      2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
  smoke)
    # The check: cuda gives the cpu run's losses to bf16 tolerance.
    python3 -m sexpgpu run examples/gpt.lisp --variant smoke --steps 200 --out /tmp/smoke-cpu \
      > "$OUT/smoke_cpu.log" 2>&1
    SEXPGPU_DEVICE=cuda python3 -m sexpgpu run examples/gpt.lisp --variant smoke --steps 200 \
      --out /tmp/smoke-cuda 2>&1 | tee "$OUT/smoke_cuda.log" | grep -v '^step' | head -60
    python3 benches/compare_runs.py /tmp/smoke-cpu /tmp/smoke-cuda 2>&1 | tee "$OUT/smoke_compare.log" ;;
  bench)
    timeout 240 python3 benches/cuda_gpt.py 2>&1 | tee "$OUT/bench_gpt2_small.log" | tail -4
    timeout 200 python3 benches/cuda_gpt.py --vocab 256 --microbatches 8 --steps 10 \
      2>&1 | tee "$OUT/bench_gpt_example.log" | tail -4 ;;
  tn)
    if [ -f benches/tn_gpu.py ]; then
      # The GPU tests live in one module (the others need h5py, zarr and quimb).
      timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/tn/test_tn_devices.py \
        2>&1 | tee "$OUT/tn_gpu_tests.log" | tail -30
      timeout 300 python3 benches/tn_gpu.py --sites 25 50 --chi 1000 --reps 3 --exact \
        2>&1 | tee "$OUT/tn_gpu_bench.log" | tail -30
    fi ;;
  probe)
    timeout 200 python3 dev/tn_gpu_probe.py 2>&1 | tee "$OUT/probe.log" ;;
  esac
done
