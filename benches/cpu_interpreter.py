"""Forward and backward of a GPT through sexpgpu's cpu interpreter vs PyTorch CPU eager.

Each side runs in its own subprocess (so peak RSS is its own): it builds the
model, runs one warm-up training step (loss and every parameter gradient),
then times `--repeats` more and reports the median wall time and the
process's peak resident memory (``ru_maxrss``). The default shape is
GPT-2 small: 12 layers, width 768, 12 heads, vocabulary 50257, sequence
1024, batch 1, in float32.

    python benches/cpu_interpreter.py                 # both sides, GPT-2 small
    python benches/cpu_interpreter.py --layers 2 --profile   # time per IR op
    python benches/cpu_interpreter.py --smoke         # a tiny GPT, in seconds (CI)

The PyTorch twin is tests/ir/torch_reference.py (the model the equality
test checks against sexpgpu). Results are recorded in benches/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

GPT = """
(defparams (layers {layers}) (width {width}) (heads {heads}) (seq {seq}) (vocab {vocab}))
(defdata text (python-stdlib) :seq seq)
(defn block (x)
  (let [x (+ x (attention (layernorm x) :heads heads :causal true))]
    (+ x (-> x layernorm (linear (* 4 width)) gelu (linear width)))))
(defmodel gpt (tokens)
  (let [wte (param [vocab width] :init (normal 0.02))]
    (-> (+ (take wte tokens) (embed (positions tokens) seq width))
        (repeat layers block)
        layernorm
        (matmul (transpose wte)))))
(defrun train :model gpt :data text :loss (cross-entropy (gpt tokens) next)
  :optimizer (adamw :lr 1e-4) :batch {batch} :steps 1)
"""


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _batch(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab, (args.batch, args.seq + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def _time(step, repeats: int) -> tuple[list[float], list[float]]:
    """Wall and process CPU seconds of each of `repeats` steps after a warm-up."""
    step()
    times, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return times, cpu


def run_sexpgpu(args: argparse.Namespace) -> dict:
    from sexpgpu.devices.cpu_device import CpuGraphs
    from sexpgpu.ir.compile import compile_run
    from sexpgpu.lang import load_experiment_text

    text = GPT.format(**vars(args))
    experiment = load_experiment_text(text, "gpt-bench.lisp")
    start = time.perf_counter()
    compiled = compile_run(experiment, experiment.run())
    program = CpuGraphs(compiled)  # the cpu device's graphs, planned on the interpreter
    compile_s = time.perf_counter() - start
    params = program.init_params(0)
    tokens, targets = _batch(args)
    batch = {"tokens": tokens, "next": targets}
    profile: dict[str, float] = defaultdict(float)
    if args.profile:
        _install_profiler(profile)
    losses = []
    times, cpu = _time(lambda: losses.append(program.train_step(params, batch)[0]), args.repeats)
    out = {
        "side": "sexpgpu",
        "times": times,
        "cpu": cpu,
        "loss": losses[-1],
        "compile_s": compile_s,
        "planned_peak_bytes": program.planned_peak_bytes,
        "measured_live_peak_bytes": program.last_peak_bytes,
        "peak_rss_bytes": _peak_rss_bytes(),
    }
    if args.profile:
        total = sum(profile.values())
        out["profile"] = {k: round(v / (args.repeats + 1), 4) for k, v in profile.items()}
        out["profile_total"] = total / (args.repeats + 1)
    return out


def _install_profiler(profile: dict[str, float]) -> None:
    """Time every op the interpreter computes (whole or split over threads), by op."""
    from sexpgpu.devices.cpu import CpuProgram

    inner = CpuProgram._compute

    def timed(self, step, values, pool):
        start = time.perf_counter()
        result = inner(self, step, values, pool)
        node = step.node
        key = node.op.label
        if key == "matmul":
            a, b = node.inputs
            key += " " + "x".join(map(str, a.shape)) + "@" + "x".join(map(str, b.shape))
        profile[key] += time.perf_counter() - start
        return result

    CpuProgram._compute = timed


def run_torch(args: argparse.Namespace) -> dict:
    import torch

    sys.path.insert(0, str(ROOT / "tests" / "ir"))
    from torch_reference import TorchGPT

    torch.manual_seed(0)
    model = TorchGPT(args.layers, args.width, args.heads, args.seq, args.vocab)
    with torch.no_grad():
        model.wte.normal_(0.0, 0.02)
    tokens, targets = (torch.from_numpy(a).long() for a in _batch(args))
    losses = []

    def step() -> None:
        model.zero_grad(set_to_none=True)
        loss = model.loss(tokens, targets)
        loss.backward()
        losses.append(loss.item())

    times, cpu = _time(step, args.repeats)
    return {
        "side": "torch",
        "times": times,
        "cpu": cpu,
        "loss": losses[-1],
        "threads": torch.get_num_threads(),
        "version": torch.__version__,
        "peak_rss_bytes": _peak_rss_bytes(),
    }


def _child(side: str, argv: list[str]) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--side", side, *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{side} side failed:\n{done.stderr}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    result["children_max_rss_bytes"] = children
    return result


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="timed steps after the warm-up")
    parser.add_argument("--side", choices=("both", "sexpgpu", "torch"), default="both")
    parser.add_argument("--profile", action="store_true", help="time each IR op (sexpgpu)")
    parser.add_argument("--smoke", action="store_true", help="a tiny GPT that runs in seconds")
    args = parser.parse_args()
    if args.smoke:
        args.layers, args.width, args.heads, args.vocab, args.seq = 1, 32, 2, 256, 16
        args.batch, args.repeats = 2, 1
    if args.side == "sexpgpu":
        print(json.dumps(run_sexpgpu(args)))
        return
    if args.side == "torch":
        print(json.dumps(run_torch(args)))
        return
    argv = [a for a in sys.argv[1:] if not a.startswith("--side")]
    torch_result = _child("torch", argv)
    ours = _child("sexpgpu", argv)
    t_ours, t_torch = statistics.median(ours["times"]), statistics.median(torch_result["times"])
    print(f"shape: {vars(args)}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cpus, {platform.processor() or ''}")
    print(f"torch {torch_result['version']} with {torch_result['threads']} threads")
    print(f"loss: sexpgpu {ours['loss']:.5f}  torch {torch_result['loss']:.5f}")
    print(f"compile (trace, autodiff, passes, plan): {ours['compile_s']:.2f} s")
    print(
        f"step time (median of {args.repeats}): sexpgpu {t_ours:.2f} s, torch {t_torch:.2f} s, "
        f"ratio {t_ours / t_torch:.2f}"
    )
    c_ours, c_torch = statistics.median(ours["cpu"]), statistics.median(torch_result["cpu"])
    print(
        f"process CPU time per step: sexpgpu {c_ours:.2f} s, torch {c_torch:.2f} s, "
        f"ratio {c_ours / c_torch:.2f}"
    )
    load = os.getloadavg()
    print(f"load average (1, 5, 15 min) at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    rss_ours, rss_torch = ours["peak_rss_bytes"], torch_result["peak_rss_bytes"]
    print(
        f"peak RSS: sexpgpu {_mib(rss_ours)}, torch {_mib(rss_torch)}, "
        f"ratio {rss_ours / rss_torch:.2f}"
    )
    print(
        f"sexpgpu planned peak {_mib(ours['planned_peak_bytes'])}, "
        f"measured live peak {_mib(ours['measured_live_peak_bytes'])}"
    )
    if "profile" in ours:
        print(f"profile (s per step, {ours['profile_total']:.2f} s in ops):")
        for key, seconds in sorted(ours["profile"].items(), key=lambda kv: -kv[1])[:25]:
            print(f"  {seconds:8.3f}  {key}")


if __name__ == "__main__":
    main()
