"""Memory amounts, budgets, plans (E-MEM-001) and peaks."""

import pytest

from sexpgpu.errors import SexpgpuError
from sexpgpu.runtime import memory
from sexpgpu.runtime.devices import Device
from sexpgpu.runtime.memory import (
    MemoryBudget,
    MemoryPlan,
    PeakTracker,
    _meminfo_available,
    detect_budget,
    host_available_bytes,
)
from sexpgpu.runtime.units import GiB, MiB, format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536 * MiB, "1.5 GiB"),
        (int(139.0 * GiB), "139.0 GiB"),
        (3 * 1024 * GiB, "3072.0 GiB"),
        (5 * MiB, "5.0 MiB"),
    ],
)
def test_format_bytes(n, text):
    assert format_bytes(n) == text


@pytest.mark.parametrize(
    ("text", "n"),
    [
        ("1", 1),
        ("2B", 2),
        ("1KiB", 1024),
        ("1kb", 1000),
        ("3MB", 3 * 10**6),
        ("1TiB", 1024**4),
        (".5GiB", GiB // 2),
        ("7.GiB", 7 * GiB),
    ],
)
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("text", ["", "GiB", "1 G", "1 gigabyte", "1/2GiB", "0.1", "-5"])
def test_parse_bytes_refuses(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


MEMINFO = """MemTotal:       32768000 kB
MemFree:         1000000 kB
MemAvailable:   20000000 kB
Buffers:          100000 kB
"""


def test_meminfo():
    assert _meminfo_available(MEMINFO) == 20000000 * 1024
    assert _meminfo_available("MemFree: 10 kB\n") == 10 * 1024
    with pytest.raises(ValueError):
        _meminfo_available("Cached: 5 kB\n")


def test_host_memory_without_psutil(tmp_path, monkeypatch):
    path = tmp_path / "meminfo"
    path.write_text(MEMINFO)
    real_find_spec = memory.importlib.util.find_spec
    monkeypatch.setattr(
        memory.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "psutil" else real_find_spec(name, *a),
    )
    assert host_available_bytes(path) == 20000000 * 1024
    # Without /proc/meminfo the physical memory stands in.
    assert host_available_bytes(tmp_path / "absent") > 0


def test_host_budget_is_real_and_positive():
    budget = detect_budget("cpu")
    assert budget.source == "host memory"
    assert budget.device == Device("cpu", 0)
    assert 0 < budget.nbytes < 2**50


def test_sexpgpu_memory_is_the_budget():
    budget = detect_budget("cpu:3", 40 * GiB)
    assert budget == MemoryBudget(Device("cpu", 3), 40 * GiB, "SEXPGPU_MEMORY")
    assert str(budget) == "40.0 GiB on cpu:3 (SEXPGPU_MEMORY)"
    # On cuda too the variable wins, and PyTorch is not asked.
    assert detect_budget("cuda:1", 40 * GiB).nbytes == 40 * GiB


def plan(budget=139 * GiB, source="free GPU memory", **parts) -> MemoryPlan:
    return MemoryPlan(MemoryBudget(Device("cuda", 0), budget, source), parts)


def test_plan_line_lists_the_parts_in_order():
    p = plan(
        activations=int(9.3 * GiB),
        parameters=GiB // 2,
        kv_cache=GiB,
        optimizer=GiB,
        gradients=GiB // 2,
    )
    assert list(p.parts) == ["parameters", "optimizer", "gradients", "activations", "kv_cache"]
    assert p.total == int(12.3 * GiB)
    assert p.fits
    assert p.line() == (
        "memory: plan 12.3 GiB of 139.0 GiB (parameters 0.5 GiB, optimizer 1.0 GiB, "
        "gradients 0.5 GiB, activations 9.3 GiB, kv_cache 1.0 GiB)"
    )


def test_peak_line():
    p = plan(parameters=10 * GiB)
    assert p.peak_line(int(10.5 * GiB)) == "memory: peak 10.5 GiB of 10.0 GiB planned (+5%)"
    assert p.peak_line(9 * GiB) == "memory: peak 9.0 GiB of 10.0 GiB planned (-10%)"
    assert plan(100).peak_line(5) == "memory: peak 5 B of 0 B planned (+0%)"
    assert plan(100, x=50).line() == "memory: plan 50 B of 100 B (x 50 B)"


def test_e_mem_001_names_the_parts_and_the_way_out():
    p = plan(40 * GiB, parameters=30 * GiB, activations=12 * GiB)
    assert not p.fits
    with pytest.raises(SexpgpuError) as info:
        p.check()
    assert info.value.render() == (
        "error[E-MEM-001]: the memory plan needs 42.0 GiB on cuda:0, 2.0 GiB more than the "
        "budget of 40.0 GiB (free GPU memory): parameters 30.0 GiB, activations 12.0 GiB\n"
        " --> cuda:0\n"
        "  = hint: use a smaller batch or more microbatches, or more devices"
    )


def test_e_mem_001_under_sexpgpu_memory_points_at_the_variable():
    p = plan(GiB, "SEXPGPU_MEMORY", activations=2 * GiB)
    with pytest.raises(SexpgpuError) as info:
        p.check(hint=":batch 64 -> 32")
    assert info.value.location == "SEXPGPU_MEMORY"
    assert info.value.hint == (
        ":batch 64 -> 32; or use a smaller batch or more microbatches, or raise "
        "SEXPGPU_MEMORY if the card has room"
    )


def test_a_plan_that_fits_passes_the_check():
    plan(GiB, parameters=GiB).check()  # exactly the budget fits


def test_peak_tracker_on_cpu():
    tracker = PeakTracker("cpu")
    for live in [10, 300, 120]:
        tracker.observe(live)
    assert tracker.peak == 300
    tracker.reset()
    assert tracker.peak == 0
