"""Where a run's wait for its first step goes: cProfile from the process's start to that step.

    python3 dev/warm_profile.py OUT.prof [--top N] -- run FILE [ARGS...]

Runs ``sexpgpu`` in this process (the arguments after ``--``) and stops the
profiler when the first step has been recorded, so the checkpoint and the
evaluation at the run's end are not counted. Prints the N largest
cumulative items, then sexpgpu's own, then a timeline: when each of the
functions in `TIMED` began and how long it took (wall clock, any thread:
cProfile sees only the thread that started it).
"""

import cProfile
import time

began = time.perf_counter()
profile = cProfile.Profile()
profile.enable()

import functools  # noqa: E402
import importlib  # noqa: E402
import pstats  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402

# module, then the attribute path of each function timed on the timeline.
TIMED = [
    ("sexpgpu.train.runner", "prepare_run"),
    ("sexpgpu.devices.cuda.device", "CudaDevice.__init__"),
    ("sexpgpu.devices.cuda.process", "open_settings"),
    ("sexpgpu.ir.compile", "compile_run"),
    ("sexpgpu.devices.cuda.planner", "Planner.plan"),
    ("sexpgpu.devices.cuda.planner", "Planner._choose"),
    ("sexpgpu.devices.cuda.planner", "Planner._stacked"),
    ("sexpgpu.devices.cuda.planner", "Planner._numbers"),
    ("sexpgpu.devices.cuda.planner", "Planner._fused_graph"),
    ("sexpgpu.devices.cuda.planner", "Planner._dry_call"),
    ("sexpgpu.devices.cuda.planner", "Planner._first_live"),
    ("sexpgpu.devices.cuda.fused", "FusedGraph._load"),
    ("sexpgpu.devices.cuda.fused", "FusedGraph.call_peak_bytes"),
    ("sexpgpu.devices.cuda.fused", "FusedGraph.__call__"),
    ("sexpgpu.devices.cuda.device", "CudaDevice.load"),
    ("sexpgpu.devices.cuda.device", "CudaDevice.report"),
]
timeline: list[tuple[float, float, str, str]] = []


def _timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            end = time.perf_counter()
            timeline.append((start - began, end - start, name, threading.current_thread().name))

    return wrapper


def _wrap_all() -> None:
    for module_name, path in TIMED:
        try:
            owner = importlib.import_module(module_name)
            *parents, last = path.split(".")
            for part in parents:
                owner = getattr(owner, part)
            setattr(owner, last, _timed(path, getattr(owner, last)))
        except (ImportError, AttributeError) as err:
            print(f"not timed: {module_name}.{path} ({err})")


def main() -> None:
    out, rest = sys.argv[1], sys.argv[2:]
    top = 60
    if rest[:1] == ["--top"]:
        top, rest = int(rest[1]), rest[2:]
    argv = rest[1:] if rest[:1] == ["--"] else rest

    _wrap_all()
    from sexpgpu.cli import main as sexpgpu_main
    from sexpgpu.train import rank

    first_step = rank.RankLoop._first_step_s

    def stop_at_first(self, step):
        seconds = first_step(self, step)
        if seconds is not None:
            profile.disable()
        return seconds

    rank.RankLoop._first_step_s = stop_at_first
    code = sexpgpu_main(argv)
    profile.disable()
    profile.dump_stats(out)
    stats = pstats.Stats(out)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("cumulative").print_stats("sexpgpu/", top)
    print("timeline (s from the process's start, first 3 calls of each):")
    seen: dict[str, int] = {}
    for start, took, name, thread in sorted(timeline):
        seen[name] = seen.get(name, 0) + 1
        if seen[name] <= 3:
            print(f"  {start:7.3f} {took:7.3f} {name} [{thread}]")
    print(f"process to end: {time.perf_counter() - began:.1f} s")
    raise SystemExit(code)


if __name__ == "__main__":
    main()
