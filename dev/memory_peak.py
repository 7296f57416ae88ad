"""What the GPU holds at a run's peak, beside its memory plan. Run on a GPU.

Two parts:

1. ``workspaces``: what cuBLAS allocates from PyTorch's caching allocator the
   first time a stream multiplies (float32, bf16, bf16 with a bias, on a
   second stream, inside a CUDA graph capture), each as the growth of the
   allocated bytes.
2. ``run``: a run of FILE on the cuda device, in this process, with the
   allocator's history recorded; after step 1, the blocks still allocated
   (what the run holds between steps) grouped by the innermost sexpgpu
   frame (else the innermost frame) that allocated them, beside the run's
   high-water mark.

    python3 dev/memory_peak.py examples/mlp.lisp [--steps 30] [--top 25]
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter, defaultdict

import torch

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
    from sexpgpu.train import prepare_run

    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    held: list[tuple[str, int]] = []

    def on_step(report) -> None:
        if report.step == 1:  # what stays allocated between steps, by where it was made
            for segment in torch.cuda.memory._snapshot()["segments"]:
                for block in segment["blocks"]:
                    if block["state"] == "active_allocated":
                        held.append((_frame(block.get("frames", [])), block["size"]))

    with tempfile.TemporaryDirectory() as out:
        trainer = prepare_run(path, out=out, device="cuda", steps=steps, on_step=on_step)
        trainer.run()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated() / MiB
    total = sum(size for _, size in held) / MiB
    print(f"run: max_memory_allocated {peak:.1f} MiB; held after step 1 {total:.1f} MiB")
    by_site: Counter = Counter()
    count: defaultdict = defaultdict(int)
    for site, size in held:
        by_site[site] += size
        count[site] += 1
    for site, size in by_site.most_common(top):
        print(f"held  {size / MiB:10.1f} MiB  {count[site]:5d} blocks  {site}")


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
