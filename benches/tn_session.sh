#!/usr/bin/env bash
# sexpgpu.tn on a lent GPU machine (one H200 is enough); logs under $OUT. From the repository root:
#   bash benches/tn_session.sh [tests|bench|products|nodes]...   (default: tests bench nodes)
# tests: the tn GPU tests (quimb objects on cuda tensors, devices, passes, CholeskyQR2, thin kernel)
# bench: the issue's target, benches/tn_gpu.py --sites 25 50 --chi 1000 --exact, five interleaved
#        reps against src-method, complex128 and complex64 (needs CuPy for src-method)
# products: complex64 with its products in double, then as they are (single)
# nodes: two node processes sharing the GPU over loopback (Gloo, since NCCL refuses a shared GPU),
#        device="gpu": every node returns one result, equal to one process's to rounding
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/sexpgpu-out}
mkdir -p "$OUT"
. benches/wheels.sh  # carried test dependencies
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for part in ${*:-tests bench nodes}; do
  case $part in
  tests)
    timeout ${TN_TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider tests/tn/test_tn_quimb.py \
      tests/tn/test_tn_devices.py tests/tn/test_tn_passes.py tests/tn/test_tn_cholqr.py tests/tn/test_tn_thin.py \
      > "$OUT/tn_gpu_tests.log" 2>&1
    tail -5 "$OUT/tn_gpu_tests.log" ;;
  bench)
    timeout ${TN_TIMEOUT:-590} python3 benches/tn_gpu.py --sites 25 50 --chi 1000 --exact --reps 5 \
      > "$OUT/tn_gpu_bench.log" 2>&1
    grep -v "^ " "$OUT/tn_gpu_bench.log" | tail -8 ;;
  products)
    # complex64's products in double (the default) against single precision,
    # each process against src-method in the same run.
    for products in double single; do
      timeout ${TN_TIMEOUT:-280} python3 benches/tn_gpu.py --sites 25 50 --chi 1000 --exact --reps 5 \
        --dtypes complex64 --gpu-memory "" --products $products > "$OUT/tn_gpu_$products.log" 2>&1
      grep -v "^ " "$OUT/tn_gpu_$products.log" | tail -3
    done ;;
  nodes)
    for r in 1 0; do
      SEXPGPU_NODES=2 SEXPGPU_NODE_RANK=$r SEXPGPU_RENDEZVOUS=127.0.0.1:29563 SEXPGPU_NODE_TIMEOUT=120 \
        PYTHONPATH=$PYTHONPATH:tests/tn timeout 300 python3 tests/tn/node_worker.py /tmp/tn-node$r.npz gpu \
        > "$OUT/tn_node$r.log" 2>&1 &
    done
    wait
    tail -n 3 "$OUT/tn_node0.log" "$OUT/tn_node1.log"
    PYTHONPATH=$PYTHONPATH:tests/tn python3 - <<'PY' 2>&1 | tee "$OUT/tn_nodes_compare.log"
import numpy as np
from node_worker import problem, solve
trains, kw = problem("gpu")
one = solve(trains, kw)
for r in (0, 1):
    with np.load(f"/tmp/tn-node{r}.npz") as d:
        got = [d[f"arr_{i}"] for i in range(len(d.files))]
    diff = max(float(np.abs(g - w).max()) for g, w in zip(got, one, strict=True))
    print(f"node {r}: {len(got)} cores, max |node - one process| = {diff:.2e}",
          "OK" if diff < 1e-4 else "DIFFERS")
PY
    ;;
  esac
done
