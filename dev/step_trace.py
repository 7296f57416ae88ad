"""Where do two runs part? Record each step's gradients and parameters, then compare runs.

    python dev/step_trace.py record TRACE.npz -- run FILE.lisp --out DIR [...]
    python dev/step_trace.py compare A.npz B.npz [C.npz ...]

`record` runs the command line given after ``--`` as ``sexpgpu`` would,
keeping before each update the step's summed loss, every gradient and
every parameter (device copies queued in stream order, so the run's timing
is disturbed as little as possible), and writes them to TRACE.npz at exit.
`compare` names, for each pair of traces, the first steps where anything
differs in its bits, and which gradients: the first tensors to part are
where a source of run-to-run variation is (benches/README.md, Determinism).
"""

from __future__ import annotations

import argparse
import atexit
import sys

import numpy as np


def record(path: str, argv: list[str]) -> int:
    from sexpgpu import cli
    from sexpgpu.devices import state

    steps: list[tuple[object, dict, dict]] = []
    update = state.TrainState.update

    def keep(x):
        return x.detach().clone() if hasattr(x, "detach") else np.array(x, copy=True)

    def recorded(self, lr, clip):
        sums = self._sums
        grads = {k: keep(v) for k, v in sums.grads.items()}
        # Named from the step's last call back: a first step's calls made while
        # tracing or planning come first, and are in one run's trace alone.
        for back, (kind, operands) in enumerate(reversed(_CALLS), start=1):
            grads |= {f"~{kind}-{back}/{field}": t for field, t in operands.items()}
        _CALLS.clear()
        steps.append((keep(sums.loss), grads, {k: keep(v) for k, v in self.values.items()}))
        return update(self, lr, clip)

    def host(x) -> np.ndarray:
        return x.float().cpu().numpy() if hasattr(x, "cpu") else np.asarray(x, np.float32)

    def save() -> None:
        out = {}
        for i, (loss, grads, params) in enumerate(steps, start=1):
            out[f"{i}/loss"] = host(loss)
            out |= {f"{i}/grad/{k}": host(v) for k, v in grads.items()}
            out |= {f"{i}/param/{k}": host(v) for k, v in params.items()}
        np.savez(path, **out)

    state.TrainState.update = recorded
    _probes()
    atexit.register(save)
    return cli.main(argv)


_CALLS: list[tuple[str, dict]] = []  # each probed call since the last update: kind, operands


def _probes() -> None:
    """Switches that take one suspect away, named by the environment (for bisecting sources).

    STEP_TRACE_GRAPHS=0: no CUDA graphs (every call plain). STEP_TRACE_FILL=1: PyTorch
    fills uninitialized memory with NaN (a read of memory never written shows).
    STEP_TRACE_SCATTER=1: each `scatter_rows` call's ids, rows and table are kept
    with the step (`~scatter-N/...`, N counted from the step's last call back; with
    STEP_TRACE_GRAPHS=0, every step's). STEP_TRACE_KERNEL=NAME: the same for each call
    of an Inductor kernel whose name holds NAME, every tensor operand before
    (`~kernel-N/inI`) and after it (`~kernel-N/outI`).
    """
    import os

    if name := os.environ.get("STEP_TRACE_KERNEL"):
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner

        run = CachingAutotuner.run

        def watched(self, *args, **kwargs):
            if name not in str(self.inductor_meta.get("kernel_name", "")):
                return run(self, *args, **kwargs)
            import torch

            tensors = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
            before = {f"in{i}": a.clone() for i, a in tensors}
            result = run(self, *args, **kwargs)
            _CALLS.append(("kernel", before | {f"out{i}": a.clone() for i, a in tensors}))
            return result

        CachingAutotuner.run = watched

    if os.environ.get("STEP_TRACE_SCATTER") == "1":
        from sexpgpu.devices.cuda import scatter_rows

        launch = scatter_rows.launch

        def kept(ids, rows, out):
            launch(ids, rows, out)
            operands = {"ids": ids, "rows": rows, "out": out}
            _CALLS.append(("scatter", {k: v.clone() for k, v in operands.items()}))

        scatter_rows.launch = kept

    if os.environ.get("STEP_TRACE_GRAPHS") == "0":
        from sexpgpu.devices.cuda import replay

        init = replay.Replay.__init__

        def plain(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.enabled = False

        replay.Replay.__init__ = plain
    if os.environ.get("STEP_TRACE_FILL") == "1":
        import torch

        from sexpgpu.devices.cuda import process

        opened = process.open_settings

        def filled(determinism: bool) -> None:
            opened(determinism)
            torch.utils.deterministic.fill_uninitialized_memory = True

        process.open_settings = filled


def _where(a: np.ndarray, b: np.ndarray) -> str:
    """The rows and columns where two 2-D arrays differ (a few of each)."""
    if a.ndim != 2:
        return ""
    rows, cols = np.nonzero(a != b)
    ur, uc = np.unique(rows), np.unique(cols)
    return f"; rows {ur[:12].tolist()} ({len(ur)}), columns {uc[:12].tolist()} ({len(uc)})"


def compare(paths: list[str], shown: int = 2) -> None:
    traces = {p: np.load(p) for p in paths}
    for i, a in enumerate(paths):
        for b in paths[i + 1 :]:
            x, y = traces[a], traces[b]
            steps = sorted({int(k.split("/")[0]) for k in x.files})
            if not steps or {k.split("/")[0] for k in y.files} != {str(s) for s in steps}:
                print(f"{a} against {b}: not comparable (the runs recorded other steps)")
                continue
            parted = 0
            print(f"{a} against {b}:")
            alone = len(set(x.files) ^ set(y.files))
            if alone:  # a probe's calls while one run traced or planned
                print(f"  {alone} recorded values in one run alone, not compared")
            for step in steps:
                keys = [k for k in x.files if k.startswith(f"{step}/")]
                bad = [k for k in keys if k in y.files and not np.array_equal(x[k], y[k])]
                if not bad:
                    continue
                grads = [k for k in bad if "/grad/" in k]
                params, loss = sum("/param/" in k for k in bad), f"{step}/loss" in bad
                print(f"  step {step}: {len(grads)} gradients, {params} parameters, loss {loss}")
                # A probe's operands first (they say where the parting began), then gradients.
                for k in sorted(grads, key=lambda k: "/~" not in k)[:40]:
                    d = x[k] != y[k]
                    print(f"    {k.split('/', 2)[2]}: {int(d.sum())} of {d.size} elements, "
                          f"largest difference {float(np.abs(x[k] - y[k]).max()):.3g}"
                          f"{_where(x[k], y[k])}")  # fmt: skip
                parted += 1
                if parted >= shown:
                    break
            if not parted:
                print("  the same bits at every step")


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "record" and "--" in sys.argv:
        at = sys.argv.index("--")
        return record(sys.argv[2], sys.argv[at + 1 :])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["compare"])
    parser.add_argument("traces", nargs="+")
    args = parser.parse_args()
    compare(args.traces)
    return 0


if __name__ == "__main__":
    sys.exit(main())
