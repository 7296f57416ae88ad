"""What the GPU holds at a run's peak, beside its memory plan. Run on a GPU.

Two parts:

1. ``workspaces``: what cuBLAS allocates from PyTorch's caching allocator the
   first time a stream multiplies (float32, bf16, bf16 with a bias, on a
   second stream, inside a CUDA graph capture), each as the growth of the
   allocated bytes.
2. ``run``: ``sexpgpu run FILE`` on the cuda device, in this process, with
   the allocator's history recorded; the history is replayed to find the
   moment the allocated total peaked, and the blocks live then are printed
   grouped by the innermost sexpgpu frame (else the innermost frame) that
   allocated them.

    SEXPGPU_DEVICE=cuda python3 dev/memory_peak.py examples/mlp.lisp [--steps 30] [--top 25]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections import Counter, defaultdict

import torch

from sexpgpu.cli import main as sexpgpu_main

MiB = 2**20


def workspaces() -> None:
    dev = torch.device("cuda")
    a32 = torch.randn(256, 256, device=dev)
    a16 = a32.to(torch.bfloat16)
    bias = torch.randn(256, device=dev, dtype=torch.bfloat16)
    torch.cuda.synchronize()

    def grew(name, fn):
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        print(f"workspace  {name:42s} +{(torch.cuda.memory_allocated() - before) / MiB:7.2f} MiB")

    grew("mm float32, current stream", lambda: a32 @ a32)
    grew("mm float32 again", lambda: a32 @ a32)
    grew("mm bf16", lambda: a16 @ a16)
    grew("addmm bf16 with a bias (cuBLASLt)", lambda: torch.addmm(bias, a16, a16))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        grew("mm float32 on a second stream", lambda: a32 @ a32)
        grew("addmm bf16 on the second stream", lambda: torch.addmm(bias, a16, a16))
    graph = torch.cuda.CUDAGraph()
    keep = []

    def capture():
        with torch.cuda.graph(graph):
            keep.append(a32 @ a32)
            keep.append(torch.addmm(bias, a16, a16))

    grew("mm + addmm captured (outputs kept)", capture)
    graph2 = torch.cuda.CUDAGraph()

    def capture2():
        with torch.cuda.graph(graph2):
            keep.append(a32 @ a32)

    grew("a second capture (its output kept)", capture2)


def _frame(frames) -> str:
    for f in frames:
        if "sexpgpu/" in f["filename"]:
            return f"{f['filename'].split('sexpgpu/', 1)[1]}:{f['line']} {f['name']}"
    for f in frames:
        if "torch/" not in f["filename"]:
            return f"{f['filename']}:{f['line']} {f['name']}"
    return f"{frames[0]['filename']}:{frames[0]['line']} {frames[0]['name']}" if frames else "?"


def run(path: str, steps: int, top: int) -> None:
    os.environ.setdefault("SEXPGPU_DEVICE", "cuda")
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    with tempfile.TemporaryDirectory() as out:
        rc = sexpgpu_main(["run", path, "--steps", str(steps), "--out", out])
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    print(f"run: exit {rc}; max_memory_allocated {torch.cuda.max_memory_allocated() / MiB:.1f} MiB")
    live: dict[int, dict] = {}
    total = peak = 0
    at_peak: dict[int, dict] = {}
    for event in snap["device_traces"][0]:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = event
            total += event["size"]
        elif action in ("free_requested", "free_completed") and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
        if total > peak:
            peak, at_peak = total, dict(live)
    print(f"run: the history's peak {peak / MiB:.1f} MiB in {len(at_peak)} blocks")
    by_site: Counter = Counter()
    count: defaultdict = defaultdict(int)
    for event in at_peak.values():
        site = _frame(event.get("frames", []))
        by_site[site] += event["size"]
        count[site] += 1
    for site, size in by_site.most_common(top):
        print(f"peak  {size / MiB:10.1f} MiB  {count[site]:5d} blocks  {site}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--parts", nargs="+", default=["workspaces", "run"])
    args = parser.parse_args()
    if "workspaces" in args.parts:
        workspaces()
    if "run" in args.parts:
        run(args.file, args.steps, args.top)


if __name__ == "__main__":
    main()
