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
3. ``call``: FILE's plan against ``--memory`` (recomputing where it must),
   then one plain call of its compiled training step on zeros with the
   allocator's history recorded: the blocks live at the call's high-water
   mark, grouped by the line of Inductor's generated code that allocated
   them (its text says the buffer's shape and the kernel), beside the plan.

    python3 dev/memory_peak.py examples/mlp.lisp [--steps 30] [--top 25]
    python3 dev/memory_peak.py big.lisp --variant bench --memory 40GiB --parts call
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


def call(path: str, variant: str | None, memory: str | None, top: int) -> None:
    import linecache

    from sexpgpu.devices.base import get_device
    from sexpgpu.devices.cuda.planner import _zero_feeds
    from sexpgpu.devices.memory_fit import recompute_lines
    from sexpgpu.ir.compile import compile_run
    from sexpgpu.lang import load_experiment
    from sexpgpu.runtime.units import parse_bytes

    experiment = load_experiment(path, variant=variant)
    run_ = experiment.run(None)
    compiled = compile_run(experiment, run_)
    budget = parse_bytes(memory) if memory else None
    plan = get_device("cuda").plan(
        compiled, optimizer=run_.optimizer.name, ranks=1, memory=budget
    )
    print(plan.memory.line())
    print(*recompute_lines(plan), sep="\n")
    fused = plan.fused
    if fused is None or isinstance(fused, str):
        print(f"no fused step: {fused}")
        return
    fused.capture = False  # plain calls: a capture's pool would hide the blocks
    feeds = _zero_feeds(fused.graph, torch, fused.device)
    buffers = fused.zero_buffers()
    fused(feeds, buffers, zeros=True)  # Inductor's first-call benchmarks, the workspaces
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    out = fused(feeds, buffers, zeros=True)
    del out
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    print(
        f"call: max_memory_allocated {(torch.cuda.max_memory_allocated() - base) / MiB:.1f} MiB "
        f"beyond its operands ({base / MiB:.1f} MiB)"
    )
    live: dict[int, tuple[int, list]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, list]] = {}
    events = snapshot["device_traces"][fused.device.index or 0]
    timeline = []  # (event index, live bytes, the line that allocated)
    for i, event in enumerate(events):
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], event.get("frames", []))
            total += event["size"]
            timeline.append((i, total, _generated(event.get("frames", []))))
            if total > peak:
                peak, at_peak = total, dict(live)
        elif event["action"] == "free_requested" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    print(
        f"call: {peak / MiB:.1f} MiB live at its peak, {len(at_peak)} blocks, {len(events)} events"
    )
    # The call's shape: live bytes at 40 points of its allocations (forward, then backward).
    for i, size, site in timeline[:: max(1, len(timeline) // 40)]:
        print(f"live  {size / MiB:9.1f} MiB at event {i:6d}  {site}")
    by_site: Counter = Counter()
    count: defaultdict = defaultdict(int)
    text: dict[str, str] = {}
    for size, frames in at_peak.values():
        site = _generated(frames)
        by_site[site] += size
        count[site] += 1
        if site not in text and ":" in site:
            name, line = site.rsplit(":", 1)
            text[site] = linecache.getline(name, int(line)).strip()[:160]
    for site, size in by_site.most_common(top):
        print(f"peak  {size / MiB:9.1f} MiB {count[site]:4d} blocks  {site}")
        print(f"      {text.get(site, '')}")


def _generated(frames) -> str:
    """The innermost frame in Inductor's generated code (else `_frame`'s)."""
    for f in frames:
        name = f["filename"]
        if "site-packages" not in name and "/sexpgpu/" not in name and name.endswith(".py"):
            return f"{name}:{f['line']}"
    return _frame(frames)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--parts", nargs="+", default=["workspaces", "run"])
    parser.add_argument("--variant")
    parser.add_argument("--memory", help="the plan's budget for `call` (SEXPGPU_MEMORY's form)")
    args = parser.parse_args()
    if "workspaces" in args.parts:
        workspaces()
    if "run" in args.parts:
        run(args.file, args.steps, args.top)
    if "call" in args.parts:
        call(args.file, args.variant, args.memory, args.top)


if __name__ == "__main__":
    main()
