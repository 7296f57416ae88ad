"""NodeLink between processes on this host (Gloo): rendezvous, fingerprints, sums."""

import json
import socket
import subprocess
import sys

import pytest

from sexpgpu.runtime.config import RuntimeConfig
from sexpgpu.runtime.nodes import NodeLink

pytest.importorskip("torch")

# One node's process: joins, sums two steps of "gradients", prints the results.
WORKER = r"""
import json, sys
import torch
from sexpgpu.errors import SexpgpuError
from sexpgpu.runtime.config import RuntimeConfig
from sexpgpu.runtime.nodes import GradientCarry, NodeLink

rank, nodes, port, dtype, experiment, timeout = sys.argv[1:]
rank, nodes = int(rank), int(nodes)
config = RuntimeConfig(device="cpu", nodes=nodes, node_rank=rank,
                       rendezvous=("127.0.0.1", int(port)), node_gradients=dtype)
try:
    link = NodeLink.open(config, {"experiment": experiment}, timeout=float(timeout))
except SexpgpuError as err:
    print(err.render(), file=sys.stderr)
    sys.exit(1)
gen = torch.Generator().manual_seed(rank)
carry = GradientCarry()
out = []
for step in range(2):
    grads = [torch.randn(3, 5, generator=gen), torch.randn(7, generator=gen).double()]
    summed = link.sum(grads, carry)
    assert [g.dtype for g in summed] == [torch.float32, torch.float64]
    out.append([g.tolist() for g in grads] + [s.tolist() for s in summed])
import numpy as np
gathered = link.gather(np.full(3, rank, np.float32))
out.append({"all": link.allgather({"node": rank, "x": 0.1 * (rank + 1)}),
            "gathered": None if gathered is None else [g.tolist() for g in gathered]})
link.barrier()
link.close()
print(json.dumps(out))
"""


# Prepended to a node's WORKER: every request to the rendezvous store waits a
# second first, as on a loaded machine where one node lags the other.
SLOW = r"""
import time
import torch.distributed as dist
for _name in ("set", "get", "wait"):
    def _slow(self, *args, _call=getattr(dist.TCPStore, _name)):
        time.sleep(1.0)
        return _call(self, *args)
    setattr(dist.TCPStore, _name, _slow)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Generous: on a loaded machine each process takes seconds just to import torch.
RENDEZVOUS_S = 120.0


def run_nodes(nodes=2, dtype="f32", experiments=None, timeout=RENDEZVOUS_S, start=None, slow=()):
    port = free_port()
    experiments = experiments or ["abc"] * nodes
    ranks = range(nodes) if start is None else start
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                SLOW + WORKER if r in slow else WORKER,
                str(r),
                str(nodes),
                str(port),
                dtype,
                experiments[r],
                str(timeout),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in ranks
    ]
    try:
        outs = [p.communicate(timeout=2 * RENDEZVOUS_S) for p in procs]
    finally:
        for p in procs:  # a failed or timed-out test leaves no process behind
            p.kill()
            p.wait()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs, strict=True)]


def test_one_node_is_a_link_to_itself():
    link = NodeLink.open(RuntimeConfig(), {"experiment": "x"})
    grads = [object()]
    assert link.sum(grads)[0] is grads[0]
    link.close()


@pytest.mark.timeout(600)
def test_two_nodes_sum_f32_in_node_order():
    torch = pytest.importorskip("torch")
    results = run_nodes(2, "f32")
    assert [rc for rc, _, _ in results] == [0, 0], results
    per_node = [json.loads(out) for _, out, _ in results]
    for step in range(2):
        g0 = [torch.tensor(x) for x in per_node[0][step][:2]]
        g1 = [torch.tensor(x) for x in per_node[1][step][:2]]
        for node in range(2):
            summed = [torch.tensor(x) for x in per_node[node][step][2:]]
            # f32 throughout, node 0 first: bitwise what one node of two ranks sums.
            assert torch.equal(summed[0], g0[0] + g1[0])
            expected = (g0[1].float() + g1[1].float()).double()
            assert torch.equal(summed[1], expected)
    for node in range(2):  # JSON values in node order on every node; gathers on node 0
        exchanged = per_node[node][2]
        assert exchanged["all"] == [{"node": 0, "x": 0.1}, {"node": 1, "x": 0.2}]
        assert exchanged["gathered"] == ([[0.0] * 3, [1.0] * 3] if node == 0 else None)


@pytest.mark.timeout(600)
def test_bf16_rounds_and_carries_the_error():
    torch = pytest.importorskip("torch")
    results = run_nodes(2, "bf16")
    assert [rc for rc, _, _ in results] == [0, 0], results
    per_node = [json.loads(out) for _, out, _ in results]
    grads = [[torch.tensor(per_node[n][s][0]) for s in range(2)] for n in range(2)]
    summed = [torch.tensor(per_node[0][s][2]) for s in range(2)]
    assert torch.equal(summed[0], torch.tensor(per_node[1][0][2]))  # every node agrees
    sent0 = [g[0].bfloat16() for g in grads]
    assert torch.equal(summed[0], sent0[0].float() + sent0[1].float())
    # Step 2 sends the gradient plus the rounding error of step 1.
    sent1 = [(g[1] + (g[0] - g[0].bfloat16().float())).bfloat16() for g in grads]
    assert torch.equal(summed[1], sent1[0].float() + sent1[1].float())
    exact = grads[0][0] + grads[1][0]
    assert not torch.equal(summed[0], exact)  # bf16 did round
    assert torch.allclose(summed[0], exact, rtol=2**-7, atol=2**-7)


@pytest.mark.timeout(600)
def test_e_dp_006_a_node_that_differs():
    results = run_nodes(2, "f32", experiments=["abc", "abd"])
    for rc, _, err in results:
        assert rc == 1
        assert err.startswith(
            "error[E-DP-006]: node 1 differs from node 0 in experiment: 'abd' on node 1, "
            "'abc' on node 0\n --> SEXPGPU_RENDEZVOUS\n"
        ), err


@pytest.mark.timeout(600)
def test_e_dp_006_when_a_node_lags():
    # Node 0 holds the store: were it to leave while node 1 still waits on a reply,
    # node 1 would see its connection closed and blame a vanished node (E-DP-007).
    results = run_nodes(2, "f32", experiments=["abc", "abd"], slow=[1])
    for rc, _, err in results:
        assert rc == 1
        assert err.startswith("error[E-DP-006]: node 1 differs from node 0 in experiment"), err
        assert "frame #" not in err


@pytest.mark.timeout(600)
def test_e_dp_007_a_node_that_never_comes():
    [(rc, _, err)] = run_nodes(2, "f32", timeout=2.0, start=[0])
    assert rc == 1
    assert err.startswith("error[E-DP-007]: node 0 waited 2 s at SEXPGPU_RENDEZVOUS=127.0.0.1:"), (
        err
    )
    assert "but not all 2 nodes arrived" in err
    assert "Traceback" not in err
