"""SRC over several nodes: one process per node, the sketch columns split over all.

Each node runs `src` in its own process with the same arguments, and the
node variables of training (``SEXPGPU_NODES``, ``SEXPGPU_NODE_RANK``,
``SEXPGPU_RENDEZVOUS``, ``SEXPGPU_NODE_TIMEOUT``), or the same fields of
`Resources`. The nodes meet through `sexpgpu.runtime.nodes.NodeLink` (the
training runtime's rendezvous: a TCP store at node 0, then torch.distributed
with NCCL between GPU nodes, Gloo between CPU nodes). Node ``n``'s ranks are
the global ranks ``n * L .. n * L + L - 1`` (``L`` devices per node), and a
`NodeContext` gives each the sweep's collectives over every rank of every
node::

    gather      local gather to the node's first rank --> node 0 (send/recv)
    scatter     node 0 --> each node's first rank --> local scatter
    allgather   local gather --> node 0 --> every node --> local broadcast
    broadcast   node 0 --> every node's first rank --> local broadcast

so the sweep, written against `comm.Context`, runs unchanged: the same
blocks, the same QR on global rank 0, the same bits as one process with as
many devices. Payloads travel as torch tensors (NumPy arrays are shared with
them without a copy), complex ones as their real pairs; their shapes go first
through `NodeLink.allgather`.

A node that fails closes its link before it raises, so the others' next
cross-node transfer fails at once (the connection is gone) and raises
E-DP-007; a node that hangs is caught by the timeout.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from sexpgpu.errors import SexpgpuError
from sexpgpu.runtime.config import RuntimeConfig
from sexpgpu.runtime.devices import Device
from sexpgpu.runtime.nodes import NodeLink

from . import gemm3m
from .comm import Context

__all__ = [
    "NodeContext",
    "NodeWire",
    "agree",
    "agree_on_call",
    "node_config",
    "open_nodes",
    "problem_key",
]

logger = logging.getLogger(__name__)

_NODE_VARS = ("SEXPGPU_NODES", "SEXPGPU_NODE_RANK", "SEXPGPU_RENDEZVOUS", "SEXPGPU_NODE_TIMEOUT")


def node_config(
    resources: Any, device: str, local: Sequence[int], environ: Mapping[str, str] | None = None
) -> RuntimeConfig:
    """The node settings: `Resources`' fields where set, else the node variables.

    Raises
    ------
    SexpgpuError
        E-DP-005 when they are malformed (checked as training checks them).
    """
    env = {k: v for k, v in (os.environ if environ is None else environ).items() if k in _NODE_VARS}
    given = {
        "SEXPGPU_NODES": resources.nodes,
        "SEXPGPU_NODE_RANK": resources.node_rank,
        "SEXPGPU_RENDEZVOUS": resources.rendezvous,
    }
    env.update({k: str(v) for k, v in given.items() if v is not None})
    read = RuntimeConfig.from_env(env, device="cpu")  # the node fields only
    return RuntimeConfig(
        device=device,
        devices=tuple(local),
        nodes=read.nodes,
        node_rank=read.node_rank,
        rendezvous=read.rendezvous,
        node_timeout=read.node_timeout,
    )


@contextmanager
def open_nodes(fn: str, config: RuntimeConfig) -> Iterator[NodeLink]:
    """Meet the other nodes (one node: a link to itself); on any error, leave at once.

    Leaving closes the transport, so a node whose call fails makes the others
    fail at their next transfer instead of waiting for the timeout.
    """
    link = NodeLink.open(config, {"sexpgpu.tn": fn})
    try:
        yield link
    finally:
        link.close()


def problem_key(parts: Mapping[str, object]) -> str:
    """A short digest of what every node must agree on (JSON-able values)."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# What node 0 gives every node, where the rest of a post must agree.
_FROM_NODE0 = ("entropy", "host products")


def agree(link: NodeLink, fn: str, problem: Mapping[str, object]) -> list[dict]:
    """Every node's ``problem``; a node whose differs from node 0's is E-DP-006."""
    if link.nodes == 1:
        return [dict(problem)]
    posts = link.allgather(dict(problem))
    first = posts[0]
    for node, other in enumerate(posts[1:], start=1):
        for key in sorted(first.keys() | other.keys()):
            if key not in _FROM_NODE0 and first.get(key) != other.get(key):
                raise SexpgpuError(
                    "E-DP-006",
                    f"{fn}: node {node} differs from node 0 in {key}: {other.get(key)!r} on "
                    f"node {node}, {first.get(key)!r} on node 0",
                    "SEXPGPU_RENDEZVOUS",
                    hint="call src with the same trains, chi_out, cutoff, oversample, "
                    "dtype and seed on every node",
                )
    return posts


def agree_on_call(link: NodeLink, fn: str, seed: object, problem: Mapping[str, object]) -> object:
    """Check that every node has the same problem and seed; the seed they all use.

    In the same exchange every node takes node 0's host products
    (`gemm3m.choices`, timed per process), so a sweep over nodes gives one
    process's bits; and ``seed=None`` draws fresh entropy on node 0, which
    every node then uses.
    """
    if link.nodes == 1:
        return seed
    state = None if seed is None else np.random.default_rng(seed).bit_generator.state  # type: ignore[arg-type]
    entropy = int(np.random.SeedSequence().entropy) if seed is None else None  # type: ignore[arg-type]
    post = {**problem, "seed": state, "entropy": entropy, "host products": gemm3m.choices()}
    posts = agree(link, fn, post)
    gemm3m.pin(posts[0]["host products"])
    return posts[0]["entropy"] if seed is None else seed


# --- the payloads ------------------------------------------------------------


_TORCH_DTYPES = ("float32", "float64", "complex64", "complex128", "bool", "int64", "uint8")


def _pack(x: Any, leaves: list[Any]) -> Any:
    """``x``'s structure as JSON, its arrays appended to ``leaves`` as tensors."""
    import torch

    if isinstance(x, list | tuple):
        return {"list": [_pack(item, leaves) for item in x]}
    if isinstance(x, np.ndarray):
        leaves.append(torch.from_numpy(np.ascontiguousarray(x)))
        return {"array": [list(x.shape), x.dtype.name, "numpy"]}
    if isinstance(x, torch.Tensor):
        leaves.append(x.contiguous())
        return {"array": [list(x.shape), str(x.dtype).removeprefix("torch."), "torch"]}
    if isinstance(x, np.generic):
        x = x.item()
    assert x is None or isinstance(x, bool | int | float | str), type(x)
    return {"value": x}


def _unpack(meta: Any, leaves: Iterator[Any]) -> Any:
    if "list" in meta:
        return [_unpack(m, leaves) for m in meta["list"]]
    if "array" in meta:
        tensor = next(leaves)
        return tensor.cpu().numpy() if meta["array"][2] == "numpy" else tensor
    return meta["value"]


def _empties(meta: Any, device: Any) -> list[Any]:
    """Receive buffers for the arrays of ``meta``, in order."""
    import torch

    if "list" in meta:
        return [t for m in meta["list"] for t in _empties(m, device)]
    if "array" in meta:
        shape, dtype, _ = meta["array"]
        assert dtype in _TORCH_DTYPES, dtype
        return [torch.empty(shape, dtype=getattr(torch, dtype), device=device)]
    return []


def _wire(tensor: Any) -> Any:
    """What travels: complex tensors as their real pairs (every transport takes those)."""
    import torch

    return torch.view_as_real(tensor.resolve_conj()) if tensor.is_complex() else tensor


class NodeWire:
    """Sends payloads (arrays, lists of them, flags) between the nodes' first ranks.

    Parameters
    ----------
    link : NodeLink
        An open link.
    device : Device
        Where this node's first rank keeps its arrays (NCCL sends from there).
    """

    def __init__(self, link: NodeLink, device: Device) -> None:
        self.link = link
        self.node = link.node_rank
        self.nodes = link.nodes
        self._home = device.torch_device() if device.is_cuda else "cpu"  # where arrays live
        self._device = "cpu" if link.backend == "gloo" else self._home  # where they travel from

    def _transfer(self, what: str, fn: Any) -> Any:
        try:
            return fn()
        except (RuntimeError, ValueError) as err:  # Gloo's and NCCL's errors, timeouts
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise SexpgpuError(
                "E-DP-007",
                f"node {self.node}: another node left the sweep or did not answer within "
                f"{self.link.timeout:g} s, during {what} ({first})",
                "SEXPGPU_NODES",
                hint="look at the other nodes' output for the first error; every node "
                "calls src with the same arguments",
            ) from err

    def _metas(self, what: str, mine: Any) -> list[Any]:
        return self._transfer(what, lambda: self.link.allgather(mine))

    def _send(self, leaves: list[Any], dst: int) -> None:
        import torch.distributed as dist

        for t in leaves:
            dist.send(_wire(t.to(self._device)), dst)

    def _recv(self, meta: Any, src: int) -> Any:
        import torch.distributed as dist

        buffers = _empties(meta, self._device)
        for t in buffers:
            dist.recv(_wire(t), src)
        return _unpack(meta, (t.to(self._home) for t in buffers))

    def gather(self, payload: Any) -> list[Any] | None:
        """Every node's payload on node 0, in node order; None elsewhere."""
        leaves: list[Any] = []
        metas = self._metas("a gather", _pack(payload, leaves))
        if self.node != 0:
            self._transfer("a gather", lambda: self._send(leaves, 0))
            return None
        return [payload] + [
            self._transfer("a gather", lambda n=n: self._recv(metas[n], n))
            for n in range(1, self.nodes)
        ]

    def scatter(self, parts: Sequence[Any] | None) -> Any:
        """Node 0's ``parts[n]`` on node ``n``."""
        packed: list[list[Any]] = [[] for _ in range(self.nodes)]
        mine = None
        if self.node == 0:
            assert parts is not None and len(parts) == self.nodes
            mine = [_pack(part, packed[n]) for n, part in enumerate(parts)]
        metas = self._metas("a scatter", mine)[0]
        if self.node == 0:
            for n in range(1, self.nodes):
                self._transfer("a scatter", lambda n=n: self._send(packed[n], n))
            return parts[0]
        return self._transfer("a scatter", lambda: self._recv(metas[self.node], 0))

    def broadcast(self, payload: Any) -> Any:
        """Node 0's payload on every node."""
        return self.scatter([payload] * self.nodes if self.node == 0 else None)

    def allgather(self, payload: Any) -> list[Any]:
        """Every node's payload on every node, in node order."""
        return self.broadcast(self.gather(payload))


class NodeContext:
    """A rank of a sweep over several nodes: local collectives, then the nodes'.

    Parameters
    ----------
    local : Context
        The rank's context among its node's devices.
    wire : NodeWire
        The node's link (used by the node's first rank only).
    """

    def __init__(self, local: Context, wire: NodeWire) -> None:
        self._local = local
        self._wire = wire
        self.rank = wire.node * local.size + local.rank
        self.size = wire.nodes * local.size
        self.device = local.device

    @property
    def devices(self) -> Sequence[Device]:
        """This node's devices (the others' are not reachable as peers)."""
        return self._local.devices

    def gather(self, x: Any, root: int = 0) -> list[Any] | None:
        """Every rank's ``x`` on global rank 0, in rank order."""
        assert root == 0
        here = self._local.gather(x, 0)
        if self._local.rank != 0:
            return None
        nodes = self._wire.gather(here)
        return None if nodes is None else [item for node in nodes for item in node]

    def scatter(self, chunks: Sequence[Any] | None, root: int = 0) -> Any:
        """Global rank 0's ``chunks[rank]`` on each rank."""
        assert root == 0
        mine = None
        if self._local.rank == 0:
            size = self._local.size
            parts = None
            if chunks is not None:
                parts = [list(chunks[n * size : (n + 1) * size]) for n in range(self._wire.nodes)]
            mine = self._wire.scatter(parts)
        return self._local.scatter(mine, 0)

    def allgather(self, x: Any) -> list[Any]:
        """Every rank's ``x`` on every rank, in rank order."""
        return self.broadcast(self.gather(x, 0), 0)

    def broadcast(self, x: Any, root: int = 0) -> Any:
        """Global rank 0's ``x`` on every rank."""
        assert root == 0
        if self._local.rank == 0:
            x = self._wire.broadcast(x)
        return self._local.broadcast(x, 0)
