"""All-reduce on a DeviceGroup against the same sum done by one thread.

Measures the time per `ctx.all_reduce` of one array over 2, 4 and 8 ranks
(simulated ``cpu`` ranks, or ``cuda`` ranks with ``--device cuda``; ranks
share the GPUs round-robin). The peer, in the same run: the sum of the ranks'
arrays in rank order by one thread (``functools.reduce(add)``) plus one copy
per rank, which is the least work an all-reduce that gives every rank its own
result can do. Best of ``--repeat`` runs of ``--steps`` collectives.

    python benches/runtime_collectives.py --mib 0.008 64 --ranks 2 4 8
    python benches/runtime_collectives.py --smoke     # 2 cpu ranks, 8 KiB, in a second (CI)
"""

from __future__ import annotations

import argparse
import functools
import time

import numpy as np

from sexpgpu.runtime.group import DeviceGroup, RankContext


def make(device: str, n: int, rank: int):
    if device == "cpu":
        return np.full(n, rank + 1.0, dtype=np.float32)
    import torch

    return torch.full((n,), rank + 1.0, dtype=torch.float32, device=f"cuda:{rank % _gpus()}")


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def group_time(device: str, ranks: int, n: int, steps: int) -> float:
    names = [f"cpu:{r}" for r in range(ranks)]
    if device == "cuda":
        names = [f"cuda:{r % _gpus()}" for r in range(ranks)]

    def step(ctx: RankContext) -> float:
        x = make(device, n, ctx.rank)
        ctx.all_reduce(x)  # warm-up
        start = time.perf_counter()
        for _ in range(steps):
            ctx.all_reduce(x)
        return (time.perf_counter() - start) / steps

    return max(DeviceGroup(names).run(step))


def peer_time(device: str, ranks: int, n: int, steps: int) -> float:
    xs = [make(device, n, r) for r in range(ranks)]

    def once() -> None:
        total = functools.reduce(lambda a, b: a + b, xs)
        for _ in range(ranks):
            total.copy() if device == "cpu" else total.clone()
        if device == "cuda":
            import torch

            torch.cuda.synchronize()

    once()
    start = time.perf_counter()
    for _ in range(steps):
        once()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--mib", type=float, nargs="+", default=[0.008, 64.0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="2 ranks, 8 KiB, 2 steps, once")
    args = parser.parse_args()
    if args.smoke:
        args.ranks, args.mib, args.steps, args.repeat = [2], [0.008], 2, 1
    print("| ranks | array | all_reduce | peer | all_reduce / peer |")
    print("|---|---|---|---|---|")
    for mib in args.mib:
        n = max(1, int(mib * 2**20 / 4))
        steps = args.steps if mib < 1 else max(3, args.steps // 4)
        for ranks in args.ranks:
            ours = min(group_time(args.device, ranks, n, steps) for _ in range(args.repeat))
            peer = min(peer_time(args.device, ranks, n, steps) for _ in range(args.repeat))
            size = f"{n * 4 / 2**20:.3g} MiB"
            print(
                f"| {ranks} | {size} | {ours * 1e3:.3f} ms | {peer * 1e3:.3f} ms "
                f"| {ours / peer:.1f} |"
            )


if __name__ == "__main__":
    main()
