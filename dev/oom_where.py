"""Where a GPU's bytes are when a run first fails to allocate: live blocks by pool and line.

    python3 dev/oom_where.py REPORT.txt SCRIPT [ARGS...]

Runs SCRIPT as ``__main__`` with PyTorch's allocator history on (Python
frames only). At the first CUDA out-of-memory it writes REPORT.txt: the
bytes allocated in each memory pool (the general one, or a CUDA graph's
private one) and, within each, the largest groups of live blocks by the
innermost frames of this project that allocated them. The run goes on as
it would have.
"""

from __future__ import annotations

import runpy
import sys
from collections import Counter
from pathlib import Path

import torch

_OURS = ("sexpgpu/", "benches/", "torchinductor")


def _where(frames: list[dict]) -> str:
    """The innermost frames of ours (or the first two) as ``file:line name`` joined."""
    ours = [f for f in frames if any(p in f["filename"] for p in _OURS)][:3]
    shown = ours or frames[:2]
    return " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in shown)


def _report(path: Path, asked: int) -> None:
    snapshot = torch.cuda.memory._snapshot()
    pools: Counter = Counter()
    lines: Counter = Counter()
    for segment in snapshot["segments"]:
        pool = str(segment.get("segment_pool_id", (0, 0)))
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            pools[pool] += block["size"]
            lines[(pool, _where(block.get("frames", [])))] += block["size"]
    out = [f"out of memory asking {asked / 2**20:.1f} MiB", "allocated by pool (GiB):"]
    out += [f"  {pool}: {size / 2**30:.2f}" for pool, size in pools.most_common()]
    out.append("largest groups of live blocks (GiB, pool, where):")
    for (pool, where), size in lines.most_common(40):
        out.append(f"  {size / 2**30:7.2f}  {pool}  {where}")
    path.write_text("\n".join(out) + "\n")


def main() -> None:
    report, script, *args = sys.argv[1:]
    path = Path(report)
    done = []

    def observer(device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        if not done:
            done.append(True)
            _report(path, alloc)

    torch.cuda.memory._record_memory_history(max_entries=10000, stacks="python")
    torch._C._cuda_attach_out_of_memory_observer(observer)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
