#!/usr/bin/env bash
# The compile cache on a GPU: `sexpgpu run examples/gpt.lisp` at full size (GPT-2 small,
# batch 8 x 8 microbatches, bf16) twice on cuda with a fresh, empty cache; the first run
# traces and compiles its step, the second must load it ("(cached)") and reach its first
# step within 5 s (a third run loads it as before the entry noted its graphs' AOTAutograd keys:
# compiled again from the saved graphs, Inductor computing each key; to compare).
# Then, optionally, the cold first step against torch.compile's.
# Logs under $OUT. Run from the repository root:
#   bash benches/cache_session.sh [runs|profile|imports|compare]...   (default: runs)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/sexpgpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
parts=${*:-runs}
STEPS=${STEPS:-2}
# DEVICE=cpu ARGS="--variant smoke" checks the script itself on a machine without a GPU.
DEVICE=${DEVICE:-cuda}
ARGS=${ARGS:-}
# The cache lives outside $OUT (Inductor's and Triton's files run to hundreds of MB);
# its size is logged.
CACHE=${CACHE:-/tmp/sexpgpu-cache-session}
# Bytecode as an installed Python keeps it: a site-packages without .pyc files (as on
# some lent machines) spends ~9 s compiling torch's modules from source on every start.
# PYTHONDONTWRITEBYTECODE (set on some lent machines) would keep the cold run from
# writing it: every run then compiled torch from source (8 s of a warm start).
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/sexpgpu-pycache}
unset PYTHONDONTWRITEBYTECODE
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"

# One run: wall seconds from the shell to its first-step line, and what the run recorded.
one_run() {
  local name=$1 log="$OUT/cache_$1.log" began
  began=$(date +%s.%N)
  XDG_CACHE_HOME=$CACHE SEXPGPU_DEVICE=$DEVICE python3 -m sexpgpu run examples/gpt.lisp $ARGS \
    --steps "$STEPS" --out "/tmp/cache-session-$name" 2>&1 | while IFS= read -r line; do
      printf '%s\n' "$line" >> "$log"
      case $line in "first step after"*)
        echo "$name: $line; $(python3 -c "import sys, time; print(f'{time.time() - float(sys.argv[1]):.1f} s from the shell')" "$began")" ;;
      esac
    done
  grep -E "^(fused:|stacking|memory: peak|done:)" "$log" | sed "s/^/$name: /"
  python3 - "/tmp/cache-session-$name" "$name" <<'EOF'
import sys
from sexpgpu.train.metrics import read_series
loss = read_series(sys.argv[1], "train/loss")
first = read_series(sys.argv[1], "runtime/first_step_s")
print(f"{sys.argv[2]}: runtime/first_step_s {first}, losses {[loss[s] for s in sorted(loss)]}")
EOF
}

for part in $parts; do
  case $part in
  runs)
    unset SEXPGPU_CACHE
    rm -rf "$CACHE" /tmp/cache-session-cold /tmp/cache-session-warm /tmp/cache-session-warm-by-graph
    one_run cold
    one_run warm
    grep -q "(cached)" "$OUT/cache_warm.log" && echo "warm: the step came from the cache" \
      || echo "warm: NOT from the cache"
    # To compare: the entry's keys dropped, so each graph loads through Inductor's own
    # key, as before the keys were noted (that run notes them again).
    python3 - "$CACHE/sexpgpu" <<'EOF'
import sys
from pathlib import Path
from sexpgpu.devices.cuda.compile_cache import StepCache
cache = StepCache(Path(sys.argv[1]))
for path in (cache.root / "steps").glob("*.step"):
    entry = cache.load(path.stem)
    cache.save(path.stem, {**entry, "keys": [None] * len(entry["graphs"])})
EOF
    one_run warm-by-graph
    du -sh "$CACHE"/* 2>/dev/null ;;
  profile)
    # Where a warm start's seconds go: one more warm run under cProfile (after `runs`).
    XDG_CACHE_HOME=$CACHE SEXPGPU_DEVICE=$DEVICE python3 -m cProfile -o "$OUT/warm.prof" \
      -m sexpgpu run examples/gpt.lisp $ARGS --steps 1 --out /tmp/cache-session-profiled \
      > "$OUT/cache_profiled.log" 2>&1
    grep "first step after" "$OUT/cache_profiled.log"
    python3 -c "import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats('cumulative').print_stats(45)" \
      "$OUT/warm.prof" | tail -60 ;;
  imports)
    # A warm start's imports, each timed by Python itself (no profiler's overhead; after `runs`).
    XDG_CACHE_HOME=$CACHE SEXPGPU_DEVICE=$DEVICE python3 -X importtime -m sexpgpu run \
      examples/gpt.lisp $ARGS --steps 1 --out /tmp/cache-session-imports \
      > "$OUT/cache_imports.log" 2> "$OUT/importtime.txt"
    grep "first step after" "$OUT/cache_imports.log"
    sort -t'|' -k2 -n -r "$OUT/importtime.txt" | head -30 ;;
  compare)
    # Cold first steps, each side with empty caches of its own (benches/gpt2_cuda.py's).
    timeout ${BENCH_TIMEOUT:-590} python3 benches/gpt2_cuda.py --batches 16 \
      --sides sexpgpu compile > "$OUT/cache_compare.log" 2>&1
    tail -8 "$OUT/cache_compare.log" ;;
  esac
done
