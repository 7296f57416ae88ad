"""Several nodes on this host: one `python -m sexpgpu run` process per node, over loopback.

Each process gets the node variables (``SEXPGPU_NODES``, ``SEXPGPU_NODE_RANK``,
``SEXPGPU_RENDEZVOUS`` on a free port) and runs on the cpu device, so the
nodes sum over Gloo. Every process is killed when the helper returns, so a
failed test leaves none behind.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# Far longer than two tiny runs need (each process imports torch); a hang fails, never blocks.
DEADLINE_S = 120.0


@dataclass
class NodeResult:
    rc: int | None
    out: str
    err: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_env(node: int, nodes: int, port: int, **extra: str) -> dict[str, str]:
    """This environment without any SEXPGPU_* variable, plus node `node`'s."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEXPGPU_")}
    env |= {
        "SEXPGPU_DEVICE": "cpu",
        "SEXPGPU_NODES": str(nodes),
        "SEXPGPU_NODE_RANK": str(node),
        "SEXPGPU_RENDEZVOUS": f"127.0.0.1:{port}",
        "SEXPGPU_NODE_TIMEOUT": "20",
    }
    return env | dict(extra)


def start_nodes(
    args: Sequence[Sequence[str]],
    *,
    envs: Sequence[Mapping[str, str]] = (),
    nodes: int | None = None,
    port: int | None = None,
    cwd: Path | None = None,
) -> list[subprocess.Popen]:
    """Start ``sexpgpu run ARGS[i]`` as node i (of `nodes`, default ``len(args)``)."""
    nodes = len(args) if nodes is None else nodes
    port = free_port() if port is None else port
    procs = []
    for node, argv in enumerate(args):
        extra = envs[node] if node < len(envs) else {}
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "sexpgpu", "run", *argv],
                env=node_env(node, nodes, port, **extra),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=cwd,
            )
        )
    return procs


def finish(procs: Sequence[subprocess.Popen], deadline: float = DEADLINE_S) -> list[NodeResult]:
    """Wait for every process (killing all at the deadline); their exit codes and output."""
    results = []
    try:
        end = time.monotonic() + deadline
        for p in procs:
            out, err = p.communicate(timeout=max(0.1, end - time.monotonic()))
            results.append(NodeResult(p.returncode, out, err))
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return results


def run_nodes(args: Sequence[Sequence[str]], **kw) -> list[NodeResult]:
    """`start_nodes` then `finish`."""
    return finish(start_nodes(args, **kw))
