"""`sexpgpu doctor`: the floor for cpu and cuda, from real and made-up hosts."""

import os
import subprocess
import sys

import pytest

from sexpgpu.cli import main
from sexpgpu.commands.doctor import Check, checks
from sexpgpu.runtime.config import ENV_VARS
from sexpgpu.runtime.probe import GpuFacts, HostFacts, probe
from sexpgpu.runtime.units import GiB


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def test_cpu_floor_is_met_here(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("sexpgpu doctor: the cpu device\n")
    assert "  ok    Python " in out and "  ok    NumPy " in out
    assert "  ok    devices  cpu:0; memory budget " in out
    assert out.endswith("the cpu floor is met\n")


def test_simulated_ranks_are_shown(capsys, monkeypatch):
    monkeypatch.setenv("SEXPGPU_DEVICES", "0,1,2")
    monkeypatch.setenv("SEXPGPU_MEMORY", "8GiB")
    assert main(["doctor", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert (
        "cpu:0, cpu:1, cpu:2 (3 ranks simulated on the host); "
        "memory budget 8.0 GiB on cpu:0 (SEXPGPU_MEMORY)"
    ) in out


def test_cuda_floor_fails_here_with_the_fix(capsys):
    if probe().gpus:
        pytest.skip("this host has a GPU")
    assert main(["doctor", "--device", "cuda"]) == 1
    out = capsys.readouterr().out
    assert "  FAIL  CUDA " in out
    assert "fix: install a CUDA build of PyTorch" in out
    assert "error[E-DP-001]: no GPU is visible for the cuda device" in out
    assert out.endswith("the cuda floor is not met: fix the 2 FAIL line(s) above\n")


def test_bad_variables_fail_the_cpu_floor(capsys, monkeypatch):
    monkeypatch.setenv("SEXPGPU_DEVICES", "0,0")
    monkeypatch.setenv("SEXPGPU_NODE_GRADIENTS", "fp8")
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert (
        "FAIL  SEXPGPU_DEVICES         error[E-DP-001]: SEXPGPU_DEVICES='0,0' names device 0 twice"
        in out
    )
    assert "fix: name each device once, such as SEXPGPU_DEVICES=0,1" in out
    assert "error[E-DP-005]: SEXPGPU_NODE_GRADIENTS='fp8' is not a gradient dtype" in out


def test_a_bad_device_name_is_reported_not_raised(capsys):
    assert main(["doctor", "--device", "gpu"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  --device  error[E-CLI-001]: --device gpu is not a device" in out


def test_no_traceback_from_the_command_line():
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SEXPGPU_")}
    done = subprocess.run(
        [sys.executable, "-m", "sexpgpu", "doctor", "--device", "cuda"],
        capture_output=True,
        text=True,
        env={**environ, "SEXPGPU_DEVICES": "0,x"},
        timeout=120,
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stdout + done.stderr
    assert "SEXPGPU_DEVICES='0,x' does not parse" in done.stdout


def gpu_host(*capabilities) -> HostFacts:
    gpus = tuple(GpuFacts(i, f"GPU model {i}", cap, 80 * GiB) for i, cap in enumerate(capabilities))
    return HostFacts(
        python=(3, 12, 3),
        numpy="2.2.0",
        torch="2.11.0+cu130",
        torch_cuda="13.0",
        driver="580.159.03",
        cudnn="9.1.0",
        nccl=None,
        gpus=gpus,
    )


def statuses(found: list[Check]) -> dict[str, str]:
    return {c.name: c.status for c in found}


def test_cuda_floor_met_on_a_good_gpu_host():
    found = checks({"SEXPGPU_MEMORY": "40GiB"}, "cuda", gpu_host((9, 0), (9, 0)))
    assert all(c.status != "FAIL" for c in found)
    by_name = {c.name: c for c in found}
    assert by_name["GPU 1"].found == "GPU model 1, capability 9.0, 80.0 GiB"
    assert by_name["CUDA"].found == "13.0 (PyTorch's build)"
    assert by_name["cuDNN"].found == "9.1.0"
    assert by_name["NCCL"].status == "info"  # reported missing, not needed on one node
    assert by_name["devices"].found == (
        "cuda:0, cuda:1; memory budget 40.0 GiB on cuda:0 (SEXPGPU_MEMORY)"
    )


def test_an_old_gpu_fails_only_when_it_is_used():
    host = gpu_host((7, 0), (8, 0))
    used = checks({"SEXPGPU_MEMORY": "1GiB"}, "cuda", host)
    assert statuses(used)["GPU 0"] == "FAIL"
    assert (
        "the cuda device needs capability 8.0 or newer" in {c.name: c for c in used}["GPU 0"].found
    )
    left_out = checks({"SEXPGPU_MEMORY": "1GiB", "SEXPGPU_DEVICES": "1"}, "cuda", host)
    assert statuses(left_out)["GPU 0"] == "info"
    assert all(c.status != "FAIL" for c in left_out)
    on_cpu = checks({}, "cpu", host)
    assert statuses(on_cpu)["GPU 0"] == "info"


def test_an_invisible_ordinal_fails_on_a_gpu_host():
    found = checks({"SEXPGPU_DEVICES": "0,2", "SEXPGPU_MEMORY": "1GiB"}, "cuda", gpu_host((9, 0)))
    by_name = {c.name: c for c in found}
    assert by_name["SEXPGPU_DEVICES"].status == "FAIL"
    assert "only 1 GPU is visible (ordinal 0)" in by_name["SEXPGPU_DEVICES"].found
    assert "devices" not in by_name


def test_old_python_and_no_numpy_fail_both_floors():
    host = HostFacts(python=(3, 10, 12), cuda_problem="PyTorch is not installed")
    for device in ("cpu", "cuda"):
        s = statuses(checks({}, device, host))
        assert s["Python"] == "FAIL" and s["NumPy"] == "FAIL"
        assert s["PyTorch"] == ("FAIL" if device == "cuda" else "info")


def test_several_nodes_need_nccl():
    environ = {
        "SEXPGPU_MEMORY": "1GiB",
        "SEXPGPU_NODES": "2",
        "SEXPGPU_NODE_RANK": "0",
        "SEXPGPU_RENDEZVOUS": "node0:29500",
    }
    found = {c.name: c for c in checks(environ, "cuda", gpu_host((9, 0)))}
    assert found["NCCL"].status == "FAIL"
    assert found["NCCL"].found == "not found: runs over several nodes are not possible"
    assert found["devices"].found.startswith("cuda:0; node 0 of 2; memory budget 1.0 GiB")
