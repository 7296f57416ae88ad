"""What is live where a run's training step peaks, by the schedule the cuda plan counts.

    python dev/live_at_peak.py FILE.lisp [--variant V] [--top 25]

Prints the peak, the node there, and the buffers live at it grouped by
(op, dtype, shape): how many and their bytes, largest first, and the ops
that read each group after the peak (through views): what keeps it. The step's
parameters are held (a whole fused step). `--cheap` makes the IR's
elementwise values again as a fusing device does (`recompute.cheap`):
those read by pointwise ops only (default), all of them, or none.
"""

import argparse
from collections import Counter

import torch

from sexpgpu.devices.cuda import executor
from sexpgpu.ir.compile import compile_run
from sexpgpu.ir.recompute import cheap, recompute_graph
from sexpgpu.lang import load_experiment

VIEWS = {"reshape", "transpose", "broadcast-to", "slice"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("file")
    parser.add_argument("--variant")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--cheap", choices=("none", "pointwise", "all"), default="pointwise")
    args = parser.parse_args()
    experiment = load_experiment(args.file, variant=args.variant)
    compiled = compile_run(experiment, experiment.run(None))
    train = compiled.train_graph
    if args.cheap != "none":
        roots = cheap(train, into_products=args.cheap == "all")
        train = recompute_graph(train, roots) if roots else train
    caught = {}

    def simulate(order, storage, nbytes, buffer_last, *, base=0, change=None, transient=None):
        n = len(order)
        dying = [[] for _ in range(n)]
        for s in set(storage):
            if buffer_last[s] < n:
                dying[max(buffer_last[s], s)].append(s)
        live, alive, best = base, set(), (base, None, set())
        for i in range(n):
            live += (change or {}).get(i, 0)
            if storage[i] == i:
                live += nbytes[i]
                alive.add(i)
            held = live + (transient[i] if transient is not None else 0)
            if held > best[0]:
                best = (held, i, set(alive))
            for s in dying[i]:
                live -= nbytes[s]
                alive.discard(s)
        caught.update(
            peak=best[0], at=best[1], alive=best[2], order=order, nbytes=nbytes, base=base,
            storage=storage,
        )
        return best[0], order[best[1]] if best[1] is not None else None

    executor.simulate_peak = simulate
    graph = executor.TorchGraph(train, torch.device("cpu"))
    graph.peak_with_params_held()
    order, nbytes = caught["order"], caught["nbytes"]
    at = order[caught["at"]]
    print(f"peak {caught['peak'] / 2**30:.2f} GiB at %{caught['at']} {at.op.label} {at.shape}")
    print(f"held all call (parameters, constants): {caught['base'] / 2**30:.2f} GiB")
    # The ops that read each buffer after the peak, through any view of it.
    position = {id(n): i for i, n in enumerate(order)}
    storage = caught["storage"]
    later: dict[int, Counter] = {}
    for j in range(caught["at"] + 1, len(order)):
        reader = order[j]
        if reader.op.label in VIEWS:
            continue
        for x in reader.inputs:
            s = storage[position[id(x)]] if id(x) in position else None
            if s is not None:
                later.setdefault(s, Counter())[reader.op.label] += 1
    groups: Counter = Counter()
    counts: Counter = Counter()
    readers: dict[tuple, Counter] = {}
    for i in caught["alive"]:
        node = order[i]
        key = (node.op.label, node.dtype.name, tuple(node.shape))
        groups[key] += nbytes[i]
        counts[key] += 1
        readers.setdefault(key, Counter()).update(later.get(i, Counter()))
    for key, b in groups.most_common(args.top):
        read = ", ".join(f"{op} x{n}" for op, n in readers[key].most_common(4)) or "-"
        print(
            f"{b / 2**20:10.1f} MiB {counts[key]:4d}x  {key[0]:14s} {key[1]:5s} "
            f"{str(key[2]):22s} read by {read}"
        )



if __name__ == "__main__":
    main()
