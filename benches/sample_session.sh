#!/usr/bin/env bash
# One call on a lent GPU machine for `sexpgpu sample` on cuda: the sampling GPU test
# (the captured step equals the op-by-op one and the interpreter), a smoke run sampled
# on cuda and on the cpu (greedy: the same text), and the decode tokens/s of GPT-2
# small (benches/sample_cuda.py). Logs under $OUT. From the repository root:
#   bash benches/sample_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/sexpgpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/train/test_sampling.py \
  > "$OUT/sample_gpu_tests.log" 2>&1; tail -5 "$OUT/sample_gpu_tests.log"
python3 -m sexpgpu run examples/gpt.lisp --variant smoke --steps 200 --out /tmp/sample-smoke \
  > "$OUT/sample_smoke_run.log" 2>&1; tail -2 "$OUT/sample_smoke_run.log"
for device in cpu cuda; do
  python3 -m sexpgpu sample examples/gpt.lisp --variant smoke --resume latest --out /tmp/sample-smoke \
    --prompt 'def main(' --tokens 120 --temperature 0 --device $device > "$OUT/sample_$device.txt" 2>&1
done
cat "$OUT/sample_cuda.txt"
if cmp -s "$OUT/sample_cpu.txt" "$OUT/sample_cuda.txt"; then echo "greedy text: cuda = cpu"
else echo "greedy text: cuda differs from cpu (bf16-free f32 smoke: should agree)"; fi
timeout 500 python3 benches/sample_cuda.py --tokens 256 --prompt 64 2>&1 | tee "$OUT/sample_cuda_bench.log"
