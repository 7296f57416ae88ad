"""Runs over several nodes: the rendezvous, the fingerprint check, cross-node sums.

One process runs per node (``SEXPGPU_NODES``), each with its own
`DeviceGroup`. Node 0 listens at ``SEXPGPU_RENDEZVOUS``; the others connect.
The traffic between nodes goes through PyTorch's ``torch.distributed`` (NCCL
between GPUs, Gloo between host tensors), never through a protocol of our own.

At the rendezvous every node shows a fingerprint (device and node counts, the
experiment's hash, the gradient dtype, the checkpoint it resumes): a node that
differs from node 0 stops the run with E-DP-006. A node that does not arrive
in time, or leaves the run, is E-DP-007.

Cross-node sums gather every node's contribution and add them up in node
order, so that the result never depends on the transport: with
``SEXPGPU_NODE_GRADIENTS=f32`` two nodes of one GPU sum exactly as one node of
two GPUs. With ``bf16`` each node sends its contribution rounded to bf16 and
keeps the rounding error in a `GradientCarry`, added to its next contribution.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sexpgpu.errors import SexpgpuError
from sexpgpu.runtime.config import NODE_TIMEOUT, RuntimeConfig

__all__ = ["RENDEZVOUS_TIMEOUT", "GradientCarry", "NodeLink"]

log = logging.getLogger(__name__)

RENDEZVOUS_TIMEOUT = NODE_TIMEOUT  # DESIGN.md: 300 s, or SEXPGPU_NODE_TIMEOUT

_PREFIX = "sexpgpu/fingerprint/"


@dataclass
class GradientCarry:
    """The bf16 rounding error a node carries into its next cross-node sum."""

    residual: Any = None  # a flat f32 tensor (or NumPy array, from a checkpoint), or None


@dataclass
class NodeLink:
    """This node's connection to the others; one node is a link to itself.

    Build it with `NodeLink.open`; close it with `close` at the end of the run.
    """

    nodes: int = 1
    node_rank: int = 0
    gradients: str = "bf16"
    timeout: float = RENDEZVOUS_TIMEOUT
    backend: str = "gloo"
    _dist: Any = field(default=None, repr=False)
    _objects: Any = field(default=None, repr=False)  # a Gloo group for host data beside NCCL

    @classmethod
    def open(
        cls,
        config: RuntimeConfig,
        fingerprint: Mapping[str, object],
        *,
        backend: str | None = None,
        timeout: float | None = None,
    ) -> NodeLink:
        """Meet the other nodes at the rendezvous and check their fingerprints.

        Parameters
        ----------
        config
            Gives the node count and rank, the rendezvous and the gradient dtype.
        fingerprint
            What must agree between nodes, by name (JSON-serialisable values).
        backend
            ``"nccl"`` or ``"gloo"``; by default NCCL on cuda, Gloo on cpu.
        timeout
            Seconds to wait for every node, at the rendezvous and at every
            collective after it; default ``config.node_timeout``.

        Raises
        ------
        SexpgpuError
            E-DP-007 when a node does not arrive in time, E-DP-006 when a
            node's fingerprint differs from node 0's.
        """
        timeout = config.node_timeout if timeout is None else timeout
        link = cls(config.nodes, config.node_rank, config.node_gradients, timeout)
        if config.nodes == 1:
            return link
        assert config.rendezvous is not None, "RuntimeConfig checks the rendezvous"
        import torch.distributed as dist

        host, port = config.rendezvous
        where = f"SEXPGPU_RENDEZVOUS={host}:{port}"
        wait = datetime.timedelta(seconds=timeout)
        try:
            store = dist.TCPStore(
                host, port, config.nodes, is_master=config.node_rank == 0, timeout=wait
            )
            places = _check_fingerprints(store, config, fingerprint)
            chosen = backend or _backend(config, places)
            dist.init_process_group(
                chosen, store=store, rank=config.node_rank, world_size=config.nodes, timeout=wait
            )
            link.backend = chosen
            if chosen != "gloo":
                link._objects = dist.new_group(backend="gloo", timeout=wait)
        except SexpgpuError:
            raise
        except RuntimeError as err:
            raise SexpgpuError(
                "E-DP-007",
                f"node {config.node_rank} waited {timeout:g} s at {where}, but not all "
                f"{config.nodes} nodes arrived ({_first_line(err)})",
                "SEXPGPU_RENDEZVOUS",
                hint="start `sexpgpu run` on every node with the same SEXPGPU_NODES and "
                "SEXPGPU_RENDEZVOUS, each with its own SEXPGPU_NODE_RANK, and check that "
                "the other nodes can reach node 0 at that address",
            ) from err
        link._dist = dist
        log.info("node %d of %d joined at %s", config.node_rank, config.nodes, where)
        return link

    def sum(self, tensors: Sequence[Any], carry: GradientCarry | None = None) -> list[Any]:
        """The sum over nodes of each tensor, taken in node order; on every node.

        Parameters
        ----------
        tensors
            This node's contributions (its ranks' sum, say): tensors on one
            device, or NumPy arrays (sent from host memory).
        carry
            Needed when the gradient dtype is bf16: the rounding error kept
            from the last call and added to this one.

        Returns
        -------
        list
            Arrays or tensors of the inputs' kinds, shapes, dtypes and device.
            With one node they are the inputs themselves.

        Raises
        ------
        SexpgpuError
            E-DP-007 when another node left the run or did not answer in time.
        """
        if self.nodes == 1 or not tensors:
            return list(tensors)
        import torch

        leaves = [_as_tensor(t) for t in tensors]
        flat, sent = self._contribution(leaves, carry)
        parts = [torch.empty_like(sent) for _ in range(self.nodes)]
        self._collective("a cross-node sum", lambda: self._dist.all_gather(parts, sent))
        parts = [p.to(flat.device) for p in parts]
        total = parts[0].to(torch.float32)
        for part in parts[1:]:
            total = total + part.to(torch.float32)  # node order: the same on every node
        pieces = total.split([t.numel() for t in leaves])
        return [
            _like(p.reshape(t.shape).to(t.dtype), original)
            for p, t, original in zip(pieces, leaves, tensors, strict=True)
        ]

    def reduce_scatter(
        self, tensors: Sequence[Any], owners: Sequence[int], carry: GradientCarry | None = None
    ) -> list[Any]:
        """`sum`, each node receiving the sums of the tensors it owns (``owners[i]``) alone.

        Each node's contribution is the one `sum` sends (bf16 with the carry,
        or f32); node n gathers every node's part of its own tensors and adds
        them in node order, so its sums are bitwise those of `sum`. Returns
        this node's tensors' sums, in order, of the inputs' kinds and dtypes.
        """
        mine = [i for i, owner in enumerate(owners) if owner == self.node_rank]
        if self.nodes == 1:
            return [tensors[i] for i in mine]
        import torch

        leaves = [_as_tensor(t) for t in tensors]
        flat, sent = self._contribution(leaves, carry)
        offsets = [0]
        for t in leaves:
            offsets.append(offsets[-1] + t.numel())
        total = None
        for node in range(self.nodes):  # one gather per node, of its tensors' parts
            part = torch.cat(
                [sent[offsets[i] : offsets[i + 1]] for i, o in enumerate(owners) if o == node]
                or [sent[:0]]
            )
            if node == self.node_rank and not part.numel():  # a node that owns nothing
                total = part.to(flat.device, torch.float32)
            if not part.numel():  # the same size on every node: no node sends
                continue
            parts = [torch.empty_like(part) for _ in range(self.nodes)]
            parts = parts if node == self.node_rank else None
            self._collective(
                "a cross-node sum",
                lambda part=part, parts=parts, node=node: self._dist.gather(
                    part, gather_list=parts, dst=node
                ),
            )
            if parts is not None:
                total = parts[0].to(flat.device, torch.float32)
                for other in parts[1:]:
                    total = total + other.to(flat.device, torch.float32)  # node order
        assert total is not None
        pieces = total.split([leaves[i].numel() for i in mine])
        return [
            _like(p.reshape(leaves[i].shape).to(leaves[i].dtype), tensors[i])
            for p, i in zip(pieces, mine, strict=True)
        ]

    def exchange(self, flat: Any, counts: Sequence[int]) -> list[Any]:
        """Every node's flat float32 host array (node n's of ``counts[n]`` elements), in order.

        Exact: the values travel as they are (parameters after a sharded update).
        """
        import numpy as np

        if self.nodes == 1:
            return [np.asarray(flat, np.float32)]
        import torch

        longest = max(counts)
        if not longest:
            return [np.zeros(0, np.float32) for _ in counts]
        mine = torch.zeros(longest, dtype=torch.float32)
        mine[: len(flat)] = torch.from_numpy(np.ascontiguousarray(flat, np.float32))
        if self.backend == "nccl":
            mine = mine.cuda()  # the rank's thread set its GPU
        parts = [torch.empty_like(mine) for _ in range(self.nodes)]
        self._collective("an exchange", lambda: self._dist.all_gather(parts, mine))
        return [p[:n].cpu().numpy() for p, n in zip(parts, counts, strict=True)]

    def allgather(self, value: Any) -> list[Any]:
        """Every node's `value` (JSON-able: numbers, strings, lists, dicts), in node order.

        Floats travel as JSON text, which reads back the same double, so sums
        of what comes back are exact and the same on every node.
        """
        if self.nodes == 1:
            return [value]
        import torch

        blob = json.dumps(value).encode()
        size = torch.tensor([len(blob)], dtype=torch.int64)
        sizes = [torch.zeros_like(size) for _ in range(self.nodes)]
        group = self._objects
        self._collective("an exchange", lambda: self._dist.all_gather(sizes, size, group=group))
        longest = int(max(s.item() for s in sizes))
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        parts = [torch.empty_like(mine) for _ in range(self.nodes)]
        self._collective("an exchange", lambda: self._dist.all_gather(parts, mine, group=group))
        return [
            json.loads(bytes(p[: int(n.item())].tolist()))
            for p, n in zip(parts, sizes, strict=True)
        ]

    def gather(self, tensor: Any) -> list[Any] | None:
        """Every node's `tensor` (one shape on all) on node 0 as host NumPy arrays; None elsewhere.

        For the bf16 residuals of a checkpoint. The tensor may live on a GPU
        or in host memory; it is sent from where the transport reads it.
        """
        import numpy as np

        if self.nodes == 1:
            return [np.array(_as_tensor(tensor).detach().cpu().numpy())]
        mine = _as_tensor(tensor).detach().contiguous()
        if self.backend != "nccl":
            mine = mine.cpu()  # Gloo gathers host tensors
        parts = [mine.new_empty(mine.shape) for _ in range(self.nodes)]
        parts = parts if self.node_rank == 0 else None
        self._collective("a gather", lambda: self._dist.gather(mine, gather_list=parts, dst=0))
        return None if parts is None else [np.array(p.cpu().numpy()) for p in parts]

    def _contribution(self, leaves: list[Any], carry: GradientCarry | None) -> tuple[Any, Any]:
        """This node's tensors as one flat f32 tensor, and what is sent of it.

        bf16: rounded with the carried error added, the new error kept in `carry`.
        """
        import torch

        flat = torch.cat([t.detach().reshape(-1).to(torch.float32) for t in leaves])
        sent = flat
        if self.gradients == "bf16":
            assert carry is not None, "bf16 cross-node sums need a GradientCarry"
            if carry.residual is not None:
                flat = flat + _as_tensor(carry.residual).to(flat.device)
            sent = flat.to(torch.bfloat16)
            carry.residual = flat - sent.to(torch.float32)
        if self.backend != "nccl":
            sent = sent.cpu()  # Gloo sends host tensors
        return flat, sent

    def barrier(self) -> None:
        """Wait until every node is here (before leaving the run, say)."""
        self.allgather(self.node_rank)

    def _collective(self, what: str, fn: Any) -> None:
        try:
            fn()
        except RuntimeError as err:  # Gloo's and NCCL's errors, their timeouts among them
            raise SexpgpuError(
                "E-DP-007",
                f"node {self.node_rank}: another node left the run or did not answer within "
                f"{self.timeout:g} s, during {what} ({_first_line(err)})",
                "SEXPGPU_NODES",
                hint="look at the other nodes' logs for the first error; resume from "
                "the last checkpoint with `--resume latest` on every node",
            ) from err

    def close(self) -> None:
        """Leave the other nodes (at the end of the run)."""
        if self._dist is not None and self._dist.is_initialized():
            self._dist.destroy_process_group()
        self._dist = None


def _as_tensor(x: Any) -> Any:
    """`x` as a tensor: tensors as they are, NumPy arrays shared without a copy."""
    import numpy as np
    import torch

    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    return x


def _like(result: Any, original: Any) -> Any:
    """`result` (a tensor) as a NumPy array where `original` was one."""
    import numpy as np

    return result.numpy() if isinstance(original, np.ndarray) else result


def _check_fingerprints(
    store: Any, config: RuntimeConfig, fingerprint: Mapping[str, object]
) -> list[list[str]]:
    """Every node posts its fingerprint; each compares all of them with node 0's.

    Returns every node's GPUs as ``host/CUDA_VISIBLE_DEVICES/ordinal`` names
    (they are not compared: they tell nodes that share a GPU).
    """
    mine = {
        **fingerprint,
        "device": config.device,
        "devices per node": config.local_size,
        "nodes": config.nodes,
        "node gradients": config.node_gradients,
    }
    posted = {"print": mine, "gpus": _gpu_names(config)}
    store.set(f"{_PREFIX}{config.node_rank}", json.dumps(posted, sort_keys=True))
    posts = [json.loads(store.get(f"{_PREFIX}{node}")) for node in range(config.nodes)]
    prints = [post["print"] for post in posts]
    error = _first_difference(prints)  # every node reads the same posts: the same verdict
    if error is not None:
        _leave_store(store, config)
        raise error
    return [post["gpus"] for post in posts]


def _leave_store(store: Any, config: RuntimeConfig) -> None:
    """Leave the store so that no node is cut off in the middle of a request.

    Node 0 holds the store: if it left while another node still waited on a
    reply (a slow node, on a loaded machine), that node would see its
    connection closed and report a vanished node (E-DP-007) instead of the
    real error. So every other node's last request is a ``set``, which needs
    no reply, and node 0 leaves only once it has seen all of them.
    """
    if config.node_rank != 0:
        store.set(f"{_PREFIX}left/{config.node_rank}", "1")
        return
    try:
        store.wait([f"{_PREFIX}left/{node}" for node in range(1, config.nodes)])
    except RuntimeError:  # a node died meanwhile: the error at hand matters more
        log.warning("a node did not confirm leaving the rendezvous")


def _first_difference(prints: list[dict[str, Any]]) -> SexpgpuError | None:
    """E-DP-006 for the first node whose fingerprint differs from node 0's; None if none."""
    first = prints[0]
    for node, other in enumerate(prints[1:], start=1):
        for key in sorted(first.keys() | other.keys()):
            if first.get(key) != other.get(key):
                return SexpgpuError(
                    "E-DP-006",
                    f"node {node} differs from node 0 in {key}: {other.get(key)!r} on node "
                    f"{node}, {first.get(key)!r} on node 0",
                    "SEXPGPU_RENDEZVOUS",
                    hint="run the same experiment, code and checkpoint with the same "
                    "SEXPGPU_* variables and GPU count on every node",
                )
    return None


def _gpu_names(config: RuntimeConfig) -> list[str]:
    if config.device != "cuda":
        return []
    where = f"{socket.gethostname()}/{os.environ.get('CUDA_VISIBLE_DEVICES', '')}"
    return [f"{where}/{index}" for index in config.devices]


def _backend(config: RuntimeConfig, places: list[list[str]]) -> str:
    """NCCL between GPUs; Gloo on cpu, and where nodes share a GPU (NCCL refuses that)."""
    if config.device != "cuda":
        return "gloo"
    names = [name for node in places for name in node]
    if len(set(names)) < len(names):
        log.info("nodes share a GPU: their sums go through Gloo, not NCCL")
        return "gloo"
    return "nccl"


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__
