"""The compile cache (`sexpgpu.devices.cuda.compile_cache`): a second run loads its step.

The end-to-end tests run the cuda lowering on PyTorch's CPU device, where
Inductor compiles C++: the first run traces and compiles, the second loads.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from device_seam import device_named

from sexpgpu.runtime.config import cache_dir

torch = pytest.importorskip("torch")

from sexpgpu.devices.cuda.compile_cache import (  # noqa: E402
    StepCache,
    open_cache,
    plan_key,
    step_key,
)
from sexpgpu.devices.cuda.device import CudaDevice  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NEEDS_CXX = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler for Inductor")

MLP = """
(defdata digits (digits) :split 0.9)
(defmodel mlp (x) (-> x (linear 32) gelu (linear 10)))
(defrun train :model mlp :data digits :loss (cross-entropy (mlp x) y)
  :optimizer (adamw :lr 1e-2) :batch 16 :microbatches 2 :steps 3 :seed 3)
"""


# ---------------------------------------------------------------- entries


def test_an_entry_reads_back_as_saved(tmp_path: Path) -> None:
    cache = StepCache(tmp_path / "c")
    assert cache.load("k") is None  # nothing saved yet, nothing made
    entry = {"graphs": [(b"\x00bytes", [((2, 3), (3, 1), torch.float32)])], "copied": ["w"]}
    cache.save("k", entry)
    assert cache.load("k") == {**entry, "format": 1}
    assert sorted(p.name for p in (tmp_path / "c" / "steps").iterdir()) == ["k.step"]


def test_a_save_cut_short_by_a_kill_leaves_nothing_once_the_cache_opens(tmp_path: Path) -> None:
    import subprocess
    import sys

    # A writer killed between writing its partial file and renaming it into place.
    code = (
        "import os, sys; from pathlib import Path; from sexpgpu.runtime import files;"
        "os.replace = lambda a, b: os.kill(os.getpid(), 9);"
        "files.replace_whole(Path(sys.argv[1]), b'half')"
    )
    entry = tmp_path / "c" / "steps" / "k.step"
    subprocess.run([sys.executable, "-c", code, str(entry)], check=False)
    assert [p.name.endswith(".tmp") for p in entry.parent.iterdir()] == [True]
    cache = StepCache(tmp_path / "c")
    assert list(entry.parent.iterdir()) == [] and cache.load("k") is None


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "flipped"])
def test_a_damaged_entry_reads_as_none(tmp_path: Path, damage: str) -> None:
    cache = StepCache(tmp_path)
    cache.save("k", {"graphs": [(b"x" * 1000, [])]})
    path = tmp_path / "steps" / "k.step"
    data = path.read_bytes()
    damaged = {
        "truncated": data[: len(data) // 2],
        "garbage": b"\x80\x04not an entry at all",
        "empty": b"",
        "flipped": data[:-10] + bytes([data[-10] ^ 1]) + data[-9:],
    }[damage]
    path.write_bytes(damaged)
    assert cache.load("k") is None


def test_an_entry_of_another_format_is_not_found(tmp_path: Path, monkeypatch) -> None:
    from sexpgpu.devices.cuda import compile_cache

    StepCache(tmp_path).save("k", {"graphs": []})
    monkeypatch.setattr(compile_cache, "FORMAT", 2)
    assert StepCache(tmp_path).load("k") is None


def test_entries_saved_at_once_read_back_whole(tmp_path: Path) -> None:
    cache = StepCache(tmp_path)
    entries = [{"graphs": [(bytes([i]) * 200_000, [])]} for i in range(6)]
    threads = [threading.Thread(target=cache.save, args=("k", e)) for e in entries]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    got = cache.load("k")
    assert got is not None and {k: v for k, v in got.items() if k != "format"} in entries
    assert [p.name for p in (tmp_path / "steps").iterdir()] == ["k.step"]  # no leftovers


def test_an_unwritable_cache_costs_nothing_but_the_entry(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("a file where the folder would be")
    cache = StepCache(blocked)
    cache.save("k", {"graphs": []})  # logged, not raised
    assert cache.load("k") is None


def test_the_key_names_graph_sums_options_settings_and_device() -> None:
    cpu = torch.device("cpu")

    def key(graph="g", device=cpu, sums=("loss",), options=None, settings=None):
        return step_key(
            graph,
            device,
            sums=sums,
            options=options or {},
            settings=settings or {"deterministic": False},
        )

    base = key()
    assert base == key()
    others = [
        key(graph="g2"),
        key(sums=("loss", "grad/w")),
        key(sums=()),
        key(options={"deterministic": True}),
        key(settings={"deterministic": True}),
        key(device=torch.device("meta")),
    ]
    assert len({base, *others}) == len(others) + 1


def test_the_key_names_the_compilers_settings_in_the_environment(monkeypatch) -> None:
    def key() -> str:
        return step_key("g", torch.device("cpu"), sums=(), options={}, settings={})

    base = key()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")  # where, not what
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "3")
    assert key() == base
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "1")  # what is compiled
    assert key() != base


def test_the_plan_key_names_both_graphs_degrees_settings_and_device() -> None:
    cpu = torch.device("cpu")

    def key(train="t", evaluation="e", device=cpu, degrees=(2, 1), settings=None):
        settings = settings or {"deterministic": False}
        return plan_key(train, evaluation, device, degrees=list(degrees), settings=settings)

    base = key()
    others = [
        key(train="t2"),
        key(evaluation="e2"),
        key(degrees=(4, 2, 1)),
        key(settings={"deterministic": True}),
        key(device=torch.device("meta")),
    ]
    assert base == key() and len({base, *others}) == len(others) + 1
    assert base != step_key("t", cpu, sums=(), options={}, settings={})


# ---------------------------------------------------------------- plans


def _smoke_gpt() -> Any:
    from sexpgpu.ir.compile import compile_run
    from sexpgpu.lang import load_experiment

    experiment = load_experiment(ROOT / "examples" / "gpt.lisp", variant="smoke")
    return compile_run(experiment, experiment.run(None))


def _plan_and_stacked(
    compiled: Any, memory: int, monkeypatch, microbatches: int = 4, deterministic: bool = False
) -> tuple[Any, list[int]]:
    """The cuda plan without a GPU (from the graphs, as `explain`), and the degrees it stacked."""
    from sexpgpu.ir import stack

    stacked: list[int] = []
    real = stack.stack_microbatches

    def counted(graph, degree):
        stacked.append(degree)
        return real(graph, degree)

    monkeypatch.setattr(stack, "stack_microbatches", counted)
    device = CudaDevice(deterministic=deterministic)
    plan = device.plan(
        compiled, optimizer="adamw", ranks=1, memory=memory, microbatches=microbatches
    )
    monkeypatch.setattr(stack, "stack_microbatches", real)
    return plan, stacked


def _same_plans(one: Any, other: Any) -> None:
    from sexpgpu.ir.printer import format_graph

    assert other.choice == one.choice
    assert other.memory == one.memory  # every part, the budget too
    assert other.live[0] == one.live[0]

    def where(node: Any) -> Any:  # the node at the peak (each plan stacks its own graph)
        return (node.op, node.shape, node.span) if hasattr(node, "op") else node

    assert where(other.live[1]) == where(one.live[1])
    assert format_graph(other.stacked) == format_graph(one.stacked)
    assert (other.recompute is None) == (one.recompute is None)


@pytest.fixture
def no_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("plans without a GPU (a GPU's plan compiles the step)")


@pytest.mark.usefixtures("no_gpu")
def test_a_second_plan_reads_each_degrees_numbers_and_stacks_only_its_choice(
    tmp_path: Path, monkeypatch
) -> None:
    compiled = _smoke_gpt()
    monkeypatch.setenv("SEXPGPU_CACHE", str(tmp_path / "cache"))
    cold, stacked = _plan_and_stacked(compiled, 2**40, monkeypatch)
    assert sorted(stacked) == [2, 4]  # every degree, to choose (1 is the graph itself)
    (entry,) = (tmp_path / "cache" / "plans").glob("*.plan")
    numbers = StepCache(tmp_path / "cache").load(entry.stem, kind="plan")["degrees"]
    assert sorted(numbers) == [1, 2, 4]
    warm, stacked = _plan_and_stacked(compiled, 2**40, monkeypatch)
    assert stacked == ([cold.choice.degree] if cold.choice.degree > 1 else [])
    _same_plans(cold, warm)
    # A budget no degree fits without recomputing plans alike from the numbers kept.
    one, _ = _plan_and_stacked(compiled, 2**40, monkeypatch, microbatches=1)
    tight = int(one.memory.total - 0.3 * one.memory.parts["activations"])
    warm_tight, _ = _plan_and_stacked(compiled, tight, monkeypatch)
    assert warm_tight.recompute is not None
    monkeypatch.setenv("SEXPGPU_CACHE", str(tmp_path / "fresh"))
    cold_tight, _ = _plan_and_stacked(compiled, tight, monkeypatch)
    _same_plans(cold_tight, warm_tight)


@pytest.mark.usefixtures("no_gpu")
def test_a_deterministic_plan_keeps_numbers_of_its_own_and_plans_alike(
    tmp_path: Path, monkeypatch
) -> None:
    compiled = _smoke_gpt()
    monkeypatch.setenv("SEXPGPU_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    fill = torch.utils.deterministic.fill_uninitialized_memory
    try:
        _plan_and_stacked(compiled, 2**40, monkeypatch)
        cold, _ = _plan_and_stacked(compiled, 2**40, monkeypatch, deterministic=True)
        warm, stacked = _plan_and_stacked(compiled, 2**40, monkeypatch, deterministic=True)
    finally:  # the process's switches as the other tests expect them
        torch.use_deterministic_algorithms(False)
        torch.utils.deterministic.fill_uninitialized_memory = fill
    # The mode is among the settings the key names: its numbers are kept apart.
    assert len(list((tmp_path / "cache" / "plans").glob("*.plan"))) == 2
    assert stacked == ([cold.choice.degree] if cold.choice.degree > 1 else [])
    _same_plans(cold, warm)


@pytest.mark.usefixtures("no_gpu")
@pytest.mark.parametrize("damage", ["truncated", "another layout"])
def test_a_damaged_plan_entry_is_computed_again(tmp_path: Path, monkeypatch, damage: str) -> None:
    compiled = _smoke_gpt()
    monkeypatch.setenv("SEXPGPU_CACHE", str(tmp_path / "cache"))
    cold, _ = _plan_and_stacked(compiled, 2**40, monkeypatch)
    (entry,) = (tmp_path / "cache" / "plans").glob("*.plan")
    cache = StepCache(tmp_path / "cache")
    if damage == "truncated":
        entry.write_bytes(entry.read_bytes()[:40])
    else:  # whole, but not numbers this planner reads
        cache.save(entry.stem, {"degrees": {"4": [1, 2]}}, kind="plan")
    again, stacked = _plan_and_stacked(compiled, 2**40, monkeypatch)
    assert sorted(stacked) == [2, 4]  # every degree computed again
    _same_plans(cold, again)
    assert sorted(cache.load(entry.stem, kind="plan")["degrees"]) == [1, 2, 4]  # kept again


# ---------------------------------------------------------------- the folder


def test_the_folder_follows_sexpgpu_cache_then_xdg(tmp_path: Path) -> None:
    assert cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/sexpgpu")
    assert cache_dir({}).parts[-2:] == (".cache", "sexpgpu")
    assert cache_dir({"SEXPGPU_CACHE": "1", "XDG_CACHE_HOME": "/x"}) == Path("/x/sexpgpu")
    assert cache_dir({"SEXPGPU_CACHE": str(tmp_path), "XDG_CACHE_HOME": "/x"}) == tmp_path
    assert cache_dir({"SEXPGPU_CACHE": "0", "XDG_CACHE_HOME": "/x"}) is None


def test_opening_points_inductor_and_triton_into_the_folder(tmp_path: Path, monkeypatch) -> None:
    cache = open_cache({"SEXPGPU_CACHE": str(tmp_path)})
    assert cache is not None and cache.root == tmp_path
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")
    assert open_cache({"SEXPGPU_CACHE": "0"}) is None
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/elsewhere"  # off: left as it was


# ---------------------------------------------------------------- runs


def _run(tmp_path: Path, name: str) -> tuple[list[float], list[str]]:
    """A fused run of the MLP on PyTorch's CPU device: its losses and its fused report line."""
    from sexpgpu.train import prepare_run
    from sexpgpu.train.metrics import read_series

    path = tmp_path / "mlp.lisp"
    path.write_text(MLP)
    with device_named("cpu", CudaDevice("cpu", fuse=True)):
        trainer = prepare_run(path, out=tmp_path / name)
    trainer.run()
    losses = read_series(tmp_path / name, "train/loss")
    assert list(read_series(tmp_path / name, "runtime/first_step_s")) == [1]
    fused = [line for line in trainer.report if line.startswith("fused: ")]
    return [losses[s] for s in sorted(losses)], fused


@NEEDS_CXX
def test_a_second_run_loads_its_step_from_the_cache_with_the_same_losses(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("SEXPGPU_CACHE", str(tmp_path / "cache"))
    first, (line,) = _run(tmp_path, "first")
    assert "traced in" in line and not line.endswith("(cached)")
    second, (again,) = _run(tmp_path, "second")
    assert again.endswith("(cached)") and "loaded from the compile cache" in again
    assert second == first  # bit for bit: the same kernels
    assert len(list((tmp_path / "cache" / "steps").glob("*.step"))) == 1


@NEEDS_CXX
def test_a_damaged_entry_or_a_lost_kernel_is_compiled_again(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SEXPGPU_CACHE", str(tmp_path / "cache"))
    first, _ = _run(tmp_path, "first")
    (path,) = (tmp_path / "cache" / "steps").glob("*.step")
    path.write_bytes(path.read_bytes()[:100])  # cut short, as by a full disk
    again, (line,) = _run(tmp_path, "again")
    assert "traced in" in line and not line.endswith("(cached)")
    assert again == first
    assert StepCache(tmp_path / "cache").load(path.stem) is not None  # saved whole again
    # The entry without Inductor's files: its graph is compiled again, and not called cached.
    shutil.rmtree(tmp_path / "cache" / "inductor")
    third, (line,) = _run(tmp_path, "third")
    assert "traced before" in line and not line.endswith("(cached)")
    assert third == first


def _entry(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    (path,) = (tmp_path / "cache" / "steps").glob("*.step")
    return path, StepCache(tmp_path / "cache").load(path.stem)


def _compiled_here(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("a graph was compiled, not loaded by its key")


@NEEDS_CXX
def test_a_second_run_loads_each_graph_by_its_key(tmp_path: Path, monkeypatch) -> None:
    from sexpgpu.devices.cuda import fused

    monkeypatch.setenv("SEXPGPU_CACHE", str(tmp_path / "cache"))
    first, _ = _run(tmp_path, "first")
    _, entry = _entry(tmp_path)
    assert len(entry["keys"]) == 1 and all(entry["keys"])
    monkeypatch.setattr(fused, "compile_part", _compiled_here)
    second, (line,) = _run(tmp_path, "second")
    assert line.endswith("(cached)") and second == first


@NEEDS_CXX
def test_a_step_keeps_its_measured_peak_and_a_later_load_reads_it(
    tmp_path: Path, monkeypatch
) -> None:
    # A warm start's dry call would call the step twice to read the same bytes again.
    from sexpgpu.devices.cuda import fused
    from sexpgpu.devices.cuda.planner import _zero_feeds
    from sexpgpu.ir.compile import compile_run
    from sexpgpu.lang import load_experiment_text

    experiment = load_experiment_text(MLP, "mlp.lisp")
    graph = compile_run(experiment, experiment.run()).train_graph
    cpu = torch.device("cpu")
    feeds = _zero_feeds(graph, torch, cpu)
    cache = StepCache(tmp_path / "cache")
    measured: list[Any] = []

    def measure(device: Any, call: Any) -> int:  # as on a GPU: the call runs, its peak is read
        call()
        measured.append(device)
        return 4096 * len(measured)

    monkeypatch.setattr(fused, "call_peak_bytes", measure)

    def step() -> Any:
        return fused.FusedGraph(graph, cpu, sums=[], examples=feeds, cache=cache)

    cold = step()
    assert cold.call_peak_bytes(feeds) == 4096 and not cold.peak_kept
    warm = step()
    assert warm.cached and warm.peak_kept and warm.call_peak_bytes(feeds) == 4096
    assert len(measured) == 1  # read from the entry, not called
    (path,) = (tmp_path / "cache" / "steps").glob("*.step")
    for bad in (-1, "4096", True, None):  # not a byte count: measured again, kept anew
        cache.save(path.stem, {**cache.load(path.stem), "peak": bad})
        again = step()
        assert again.cached and not again.peak_kept
        assert again.call_peak_bytes(feeds) == 4096 * len(measured)
    assert len(measured) == 5 and cache.load(path.stem)["peak"] == 4096 * 5


@NEEDS_CXX
def test_a_key_that_finds_nothing_is_compiled_and_noted_again(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SEXPGPU_CACHE", str(tmp_path / "cache"))
    first, _ = _run(tmp_path, "first")
    path, entry = _entry(tmp_path)
    for stale in ([None], ["0" * 52]):  # an entry of before the keys; a key of nothing
        StepCache(tmp_path / "cache").save(path.stem, {**entry, "keys": stale})
        again, (line,) = _run(tmp_path, f"again-{stale[0]}")
        assert line.endswith("(cached)") and again == first  # Inductor's cache served it
        assert _entry(tmp_path)[1]["keys"] == entry["keys"]  # noted again


@NEEDS_CXX
def test_a_load_by_key_that_fails_is_logged_and_compiled(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache

    monkeypatch.setenv("SEXPGPU_CACHE", str(tmp_path / "cache"))
    first, _ = _run(tmp_path, "first")

    def another_layout(*args: Any, **kwargs: Any) -> None:
        raise AttributeError("no such field")

    monkeypatch.setattr(AOTAutogradCache, "_lookup", staticmethod(another_layout))
    again, (line,) = _run(tmp_path, "again")
    assert "did not load by its key (AttributeError: no such field)" in caplog.text
    assert "traced before" not in line and again == first  # Inductor's FX graph cache served it


@NEEDS_CXX
def test_damaged_inductor_files_are_compiled_again_then_loaded_by_key(
    tmp_path: Path, monkeypatch
) -> None:
    from sexpgpu.devices.cuda import fused

    monkeypatch.setenv("SEXPGPU_CACHE", str(tmp_path / "cache"))
    first, _ = _run(tmp_path, "first")
    for name in ("aotautograd", "fxgraph"):
        for path in (tmp_path / "cache" / "inductor" / name).rglob("*"):
            if path.is_file():
                path.write_bytes(os.urandom(64))
    again, (line,) = _run(tmp_path, "again")
    assert "traced before" in line and not line.endswith("(cached)")
    assert again == first
    monkeypatch.setattr(fused, "compile_part", _compiled_here)
    third, (line,) = _run(tmp_path, "third")
    assert line.endswith("(cached)") and third == first


@NEEDS_CXX
def test_with_the_cache_off_nothing_is_kept(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SEXPGPU_CACHE", "0")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    _, (line,) = _run(tmp_path, "off")
    assert not line.endswith("(cached)")
    assert not (tmp_path / "xdg" / "sexpgpu" / "steps").exists()


_CONCURRENT = """
import sys
from pathlib import Path
from device_seam import device_named
from sexpgpu.devices.cuda.device import CudaDevice
from sexpgpu.train import prepare_run
from sexpgpu.train.metrics import read_series

with device_named("cpu", CudaDevice("cpu", fuse=True)):
    trainer = prepare_run(Path(sys.argv[1]), out=sys.argv[2])
trainer.run()
losses = read_series(sys.argv[2], "train/loss")
print(repr([losses[s] for s in sorted(losses)]))
"""


@pytest.mark.slow
@NEEDS_CXX
def test_two_runs_at_once_share_the_cache(tmp_path: Path) -> None:
    path = tmp_path / "mlp.lisp"
    path.write_text(MLP)
    paths = [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, paths)),
        "SEXPGPU_CACHE": str(tmp_path / "cache"),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CONCURRENT, str(path), str(tmp_path / f"run{i}")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [proc.communicate(timeout=500) for proc in procs]
    for proc, (_, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0, err[-3000:]
    assert outs[0][0] == outs[1][0]
    (entry,) = (tmp_path / "cache" / "steps").glob("*.step")
    assert StepCache(tmp_path / "cache").load(entry.stem) is not None
    assert not list((tmp_path / "cache" / "steps").glob("*.tmp"))
