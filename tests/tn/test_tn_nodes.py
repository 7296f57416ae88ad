"""SRC over several nodes: loopback processes on the CPU, over Gloo.

Each node is its own process (`node_worker.py`), as on a cluster. The result
must be bitwise that of one process with as many ranks (`Resources(devices=)`),
and a node that fails must stop every node with an E-DP code. Nothing here is
timed: the processes get minutes, and a healthy run takes seconds.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from node_worker import problem, solve

from sexpgpu.errors import SexpgpuError
from sexpgpu.tn import Resources
from sexpgpu.tn.nodes import node_config

WORKER = Path(__file__).parent / "node_worker.py"
ROOT = Path(__file__).resolve().parents[2]
# Generous: other work may load the machine; a healthy run takes seconds.
PATIENCE = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_nodes(tmp_path: Path, nodes: int, case: str, failing: int | None = None) -> list:
    port = _free_port()
    procs = []
    for rank in range(nodes):
        env = {
            **os.environ,
            "PYTHONPATH": f"{ROOT}{os.pathsep}{WORKER.parent}",
            "SEXPGPU_NODES": str(nodes),
            "SEXPGPU_NODE_RANK": str(rank),
            "SEXPGPU_RENDEZVOUS": f"127.0.0.1:{port}",
            "SEXPGPU_NODE_TIMEOUT": str(PATIENCE),
            "OPENBLAS_NUM_THREADS": "1",
        }
        args = [sys.executable, str(WORKER), str(tmp_path / f"node{rank}.npz"), case]
        if rank == failing:
            args.append("fail")
        procs.append(
            subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    outputs = []
    for proc in procs:
        try:
            text, _ = proc.communicate(timeout=PATIENCE + 120)
        finally:
            if proc.poll() is None:
                proc.kill()
        outputs.append((proc.returncode, text.decode(errors="replace")))
    return outputs


def _cores(path: Path) -> list[np.ndarray]:
    with np.load(path) as data:
        return [data[f"arr_{i}"] for i in range(len(data.files))]


@pytest.mark.parametrize(
    ("nodes", "case"),
    [(2, "ket"), (3, "ket"), (2, "complex-oversampled"), (2, "two-devices"), (2, "torch-backend")],
)
def test_nodes_give_the_bits_of_one_process_with_as_many_ranks(tmp_path, nodes, case):
    outputs = _run_nodes(tmp_path, nodes, case)
    for rank, (code, text) in enumerate(outputs):
        assert code == 0, f"node {rank} failed:\n{text}"
    trains, kw = problem(case)
    local = kw.pop("resources", Resources()).device_ids or (0,)
    one = solve(trains, {**kw, "resources": Resources(devices=nodes * len(local))})
    alone = solve(trains, kw)
    for rank in range(nodes):
        got = _cores(tmp_path / f"node{rank}.npz")
        assert len(got) == len(one)
        for g, want, single in zip(got, one, alone, strict=True):
            assert g.dtype == want.dtype and g.shape == want.shape
            np.testing.assert_array_equal(g, want)  # every node returns the result
            np.testing.assert_allclose(g, single, atol=1e-12)  # one device: to rounding


@pytest.mark.parametrize(("nodes", "failing"), [(2, 1), (3, 0)])
def test_a_failing_node_stops_every_node_with_an_e_dp_code(tmp_path, nodes, failing):
    outputs = _run_nodes(tmp_path, nodes, "ket", failing=failing)
    for rank, (code, text) in enumerate(outputs):
        if rank == failing:
            assert code != 0 and "simulated failure of this node" in text
            continue
        assert code == 3, f"node {rank} did not stop with an E-DP code:\n{text}"
        with np.load(tmp_path / f"node{rank}.npz") as data:
            assert str(data["code"]).startswith("E-DP-"), str(data["message"])


def test_node_settings_from_resources_win_over_the_variables():
    env = {"SEXPGPU_NODES": "4", "SEXPGPU_NODE_RANK": "3", "SEXPGPU_RENDEZVOUS": "h:1"}
    res = Resources(nodes=2, node_rank=1, rendezvous="127.0.0.1:29500")
    config = node_config(res, "cpu", [0], env)
    assert (config.nodes, config.node_rank, config.rendezvous) == (2, 1, ("127.0.0.1", 29500))
    assert node_config(Resources(), "cpu", [0], {}).nodes == 1
    with pytest.raises(SexpgpuError) as info:
        node_config(Resources(nodes=2, node_rank=5, rendezvous="127.0.0.1:1"), "cpu", [0], {})
    assert info.value.code == "E-DP-005"


def test_every_node_takes_node_0s_host_products(monkeypatch):
    """Whether the 3M GEMM pays is timed per process; the nodes of one sweep take node 0's."""
    from sexpgpu.tn import gemm3m
    from sexpgpu.tn.nodes import agree_on_call

    class TwoNodes:
        nodes = 2

        def allgather(self, mine):  # node 0's post, with its choice, then this node's
            return [{**mine, "host products": {"D": True, "F": False}}, mine]

    monkeypatch.setattr(gemm3m, "_pinned", {})
    monkeypatch.setenv(gemm3m.ENV, "0")  # this node alone would take the plain product
    gemm3m._decided.cache_clear()
    try:
        agree_on_call(TwoNodes(), "src", 0, {})
    finally:
        gemm3m._decided.cache_clear()  # later tests time this machine again
    assert gemm3m._pinned == {"D": True, "F": False}
