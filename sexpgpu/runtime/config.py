"""The runtime's configuration: ``--device`` and the ``SEXPGPU_*`` variables.

All of them are read and checked here, once, into a frozen `RuntimeConfig`.
The environment and the number of visible GPUs are passed in, so that every
case is testable without a GPU and nothing is read behind the caller's back.

=========================  =========================================  ==========
variable                   meaning                                    default
=========================  =========================================  ==========
SEXPGPU_DEVICE             ``cpu`` or ``cuda`` (``--device`` wins)    ``cpu``
SEXPGPU_DEVICES            ordinals ``0,1``: GPUs on cuda, simulated  every GPU;
                           ranks on cpu                               ``0`` on cpu
SEXPGPU_MEMORY             the per-device memory budget, ``40GiB``    detected
SEXPGPU_NODES              how many nodes run together                ``1``
SEXPGPU_NODE_RANK          this node's number, 0 to nodes - 1         ``0``
SEXPGPU_RENDEZVOUS         ``host:port`` where node 0 listens         none
SEXPGPU_NODE_GRADIENTS     ``bf16`` or ``f32`` cross-node sums        ``bf16``
SEXPGPU_NODE_TIMEOUT       seconds a node waits for the others        ``300``
SEXPGPU_DETERMINISTIC      ``1``: cuda runs repeat bit for bit;       the cuda
                           ``0``: the fastest kernels                 device's
SEXPGPU_SHARD_OPTIMIZER    ``1``: each rank keeps its shard of the    the plan's
                           optimizer state; ``0``: every rank all     choice
SEXPGPU_CACHE              ``0``: no compiled steps kept; a folder:   ``$XDG_CACHE_HOME
                           the cache's folder                         /sexpgpu``
=========================  =========================================  ==========

Several nodes run on ``cuda`` or on ``cpu``: cpu nodes sum over Gloo, to
rehearse a launch (and to test every node path) without GPUs, as simulated
ranks rehearse several GPUs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sexpgpu.errors import SexpgpuError
from sexpgpu.runtime.devices import DEVICE_KINDS, Device, visible_gpu_count
from sexpgpu.runtime.units import parse_bytes

__all__ = [
    "ENV_VARS",
    "NODE_GRADIENT_DTYPES",
    "NODE_TIMEOUT",
    "RuntimeConfig",
    "cache_dir",
    "check_env",
    "deterministic_setting",
    "shard_setting",
]

ENV_VARS: tuple[str, ...] = (
    "SEXPGPU_DEVICE",
    "SEXPGPU_DEVICES",
    "SEXPGPU_MEMORY",
    "SEXPGPU_NODES",
    "SEXPGPU_NODE_RANK",
    "SEXPGPU_RENDEZVOUS",
    "SEXPGPU_NODE_GRADIENTS",
    "SEXPGPU_NODE_TIMEOUT",
    "SEXPGPU_DETERMINISTIC",
    "SEXPGPU_SHARD_OPTIMIZER",
    "SEXPGPU_CACHE",
)
NODE_GRADIENT_DTYPES: tuple[str, ...] = ("bf16", "f32")
# DESIGN.md: a node that has not arrived after 300 s stops the run.
NODE_TIMEOUT = 300.0


@dataclass(frozen=True)
class RuntimeConfig:
    """Where a run computes, checked: build it with `RuntimeConfig.from_env`.

    Attributes
    ----------
    device
        ``"cpu"`` or ``"cuda"``.
    devices
        The local ordinals, one rank each: GPUs on cuda, simulated ranks on cpu.
    memory
        The per-device budget in bytes from ``SEXPGPU_MEMORY``; None: detect it.
    nodes, node_rank
        How many nodes run together and which one this is.
    rendezvous
        ``(host, port)`` where node 0 listens; None on one node.
    node_gradients
        ``"bf16"`` or ``"f32"``: the dtype of cross-node gradient sums.
    node_timeout
        Seconds a node waits for the others, at the rendezvous and at each
        cross-node collective, before the run stops with E-DP-007.
    deterministic
        ``SEXPGPU_DETERMINISTIC``: whether cuda runs repeat bit for bit;
        None: the cuda device's default.
    shard_optimizer
        ``SEXPGPU_SHARD_OPTIMIZER``: whether each of several ranks keeps the
        optimizer state of its shard alone; None: the memory plan chooses.
    """

    device: str = "cpu"
    devices: tuple[int, ...] = (0,)
    memory: int | None = None
    nodes: int = 1
    node_rank: int = 0
    rendezvous: tuple[str, int] | None = None
    node_gradients: str = "bf16"
    node_timeout: float = NODE_TIMEOUT
    deterministic: bool | None = None
    shard_optimizer: bool | None = None

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str],
        device: str | None = None,
        visible_gpus: int | None = None,
    ) -> RuntimeConfig:
        """Read and check the configuration.

        Parameters
        ----------
        environ
            The environment, such as ``os.environ``.
        device
            The ``--device`` argument; it wins over ``SEXPGPU_DEVICE``.
        visible_gpus
            How many GPUs are visible; None asks PyTorch, and only on cuda.

        Raises
        ------
        SexpgpuError
            The first problem that `check_env` would list: E-CLI-001 for
            a bad device name or memory amount, E-DP-001 for the device list,
            E-DP-005 for the node variables.
        """
        values, problems = _read(environ, device, visible_gpus)
        if problems:
            raise problems[0]
        return cls(**values)

    @property
    def local_devices(self) -> tuple[Device, ...]:
        """This node's devices in rank order (``cuda:0``, ``cuda:1``, or ``cpu:N``)."""
        return tuple(Device(self.device, index) for index in self.devices)

    @property
    def local_size(self) -> int:
        """How many ranks run on this node."""
        return len(self.devices)

    @property
    def world_size(self) -> int:
        """How many ranks run on all nodes together."""
        return self.nodes * self.local_size

    @property
    def first_rank(self) -> int:
        """The global rank of this node's first device."""
        return self.node_rank * self.local_size

    @property
    def simulated(self) -> bool:
        """Whether the ranks are simulated on the host (cpu with several ranks)."""
        return self.device == "cpu" and self.local_size > 1


def check_env(
    environ: Mapping[str, str],
    device: str | None = None,
    visible_gpus: int | None = None,
) -> list[SexpgpuError]:
    """Every problem in the configuration, one error per variable (empty: all good).

    The arguments are those of `RuntimeConfig.from_env`; ``sexpgpu doctor``
    uses this to report all problems at once rather than the first.
    """
    return _read(environ, device, visible_gpus)[1]


def _read(
    environ: Mapping[str, str], device: str | None, visible_gpus: int | None
) -> tuple[dict[str, Any], list[SexpgpuError]]:
    values: dict[str, Any] = {}
    problems: list[SexpgpuError] = []

    def attempt(name: str, parse: Callable[[], Any]) -> None:
        try:
            values[name] = parse()
        except SexpgpuError as err:
            problems.append(err)

    kind_from = "--device" if device is not None else "SEXPGPU_DEVICE"
    attempt("device", lambda: _device_kind(device, environ))
    kind = values.get("device")
    # With a bad device name, the list is still checked for its syntax.
    attempt("devices", lambda: _device_list(environ, kind or "cpu", kind_from, visible_gpus))
    attempt("memory", lambda: _memory(environ.get("SEXPGPU_MEMORY", "")))
    attempt("nodes", lambda: _nodes(environ))
    nodes = values.get("nodes")
    if nodes is not None:
        attempt("node_rank", lambda: _node_rank(environ, nodes))
        attempt("rendezvous", lambda: _rendezvous(environ, nodes))
    attempt("node_gradients", lambda: _node_gradients(environ))
    attempt("node_timeout", lambda: _node_timeout(environ))
    attempt("deterministic", lambda: deterministic_setting(environ))
    attempt("shard_optimizer", lambda: shard_setting(environ))
    return values, problems


def _quote(value: str) -> str:
    return f"'{value}'"


def _device_kind(device: str | None, environ: Mapping[str, str]) -> str:
    location = "--device" if device is not None else "SEXPGPU_DEVICE"
    text = device if device is not None else environ.get("SEXPGPU_DEVICE", "")
    kind = text.strip().lower() or DEVICE_KINDS[0]
    if kind not in DEVICE_KINDS:
        shown = f"--device {text}" if device is not None else f"SEXPGPU_DEVICE={_quote(text)}"
        raise SexpgpuError(
            "E-CLI-001",
            f"{shown} is not a device",
            location,
            hint=f"use {DEVICE_KINDS[0]} (the default) or {' or '.join(DEVICE_KINDS[1:])}",
        )
    return kind


def _device_list(
    environ: Mapping[str, str], kind: str, kind_from: str, visible_gpus: int | None
) -> tuple[int, ...]:
    text = environ.get("SEXPGPU_DEVICES", "").strip()
    ordinals = _parse_ordinals(text) if text else None
    if kind == "cpu":
        # Simulated ranks: any distinct ordinals; one rank when unset.
        return ordinals if ordinals is not None else (0,)
    visible = visible_gpu_count() if visible_gpus is None else visible_gpus
    if visible < 1:
        raise SexpgpuError(
            "E-DP-001",
            "no GPU is visible for the cuda device",
            kind_from,
            hint="the cuda device needs a CUDA build of PyTorch and a visible GPU (`sexpgpu "
            "doctor --device cuda` says which is missing); or use the cpu device, where "
            "SEXPGPU_DEVICES=0,1 simulates two ranks on the host",
        )
    if ordinals is None:
        return tuple(range(visible))
    for ordinal in ordinals:
        if ordinal >= visible:
            seen = (
                "1 GPU is visible (ordinal 0)"
                if visible == 1
                else (f"{visible} GPUs are visible (ordinals 0 to {visible - 1})")
            )
            raise SexpgpuError(
                "E-DP-001",
                f"SEXPGPU_DEVICES={_quote(text)} names GPU {ordinal}, but only {seen}",
                "SEXPGPU_DEVICES",
                hint=f"name ordinals below {visible}, or unset SEXPGPU_DEVICES to use every "
                "visible GPU (CUDA_VISIBLE_DEVICES and nvidia-smi show which are visible)",
            )
    return ordinals


def _parse_ordinals(text: str) -> tuple[int, ...]:
    ordinals: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise SexpgpuError(
                "E-DP-001",
                f"SEXPGPU_DEVICES={_quote(text)} does not parse: {_quote(part)} is not a "
                "device ordinal",
                "SEXPGPU_DEVICES",
                hint="write ordinals separated by commas, such as SEXPGPU_DEVICES=0,1, "
                "or unset it to use every visible GPU",
            )
        if int(part) in ordinals:
            raise SexpgpuError(
                "E-DP-001",
                f"SEXPGPU_DEVICES={_quote(text)} names device {int(part)} twice",
                "SEXPGPU_DEVICES",
                hint="name each device once, such as SEXPGPU_DEVICES=0,1",
            )
        ordinals.append(int(part))
    return tuple(ordinals)


def _memory(text: str) -> int | None:
    if not text.strip():
        return None
    try:
        return parse_bytes(text)
    except ValueError:
        raise SexpgpuError(
            "E-CLI-001",
            f"SEXPGPU_MEMORY={_quote(text)} is not an amount of memory",
            "SEXPGPU_MEMORY",
            hint="write a number with a unit, such as SEXPGPU_MEMORY=40GiB, 40GB or 512MiB, "
            "or a plain number of bytes; unset it to detect the free memory",
        ) from None


def deterministic_setting(environ: Mapping[str, str]) -> bool | None:
    """``SEXPGPU_DETERMINISTIC``: True (``1``), False (``0``), or None when unset.

    Unset, the cuda device takes its default (docs/devices.md says which and why).
    """
    return _switch(
        environ,
        "SEXPGPU_DETERMINISTIC",
        "SEXPGPU_DETERMINISTIC=1 replaces the cuda device's run-to-run sources of different "
        "bits, 0 takes the fastest kernels; unset it for the device's default",
    )


def shard_setting(environ: Mapping[str, str]) -> bool | None:
    """``SEXPGPU_SHARD_OPTIMIZER``: True (``1``), False (``0``), or None when unset (the plan's)."""
    return _switch(
        environ,
        "SEXPGPU_SHARD_OPTIMIZER",
        "SEXPGPU_SHARD_OPTIMIZER=1 keeps each rank's shard of the optimizer state alone, "
        "0 the whole state on every rank; unset it to let the memory plan choose",
    )


def _switch(environ: Mapping[str, str], name: str, hint: str) -> bool | None:
    """A ``0``/``1`` variable: True, False, or None when unset; anything else is refused."""
    text = environ.get(name, "").strip()
    if not text:
        return None
    if text in ("0", "1"):
        return text == "1"
    raise SexpgpuError("E-CLI-001", f"{name}={_quote(text)} is neither 0 nor 1", name, hint=hint)


def cache_dir(environ: Mapping[str, str]) -> Path | None:
    """Where compiled steps and remembered choices are kept; None with ``SEXPGPU_CACHE=0``.

    ``SEXPGPU_CACHE`` names the folder; unset (or ``1``) it is
    ``$XDG_CACHE_HOME/sexpgpu``, ``~/.cache/sexpgpu`` without ``XDG_CACHE_HOME``.
    """
    text = environ.get("SEXPGPU_CACHE", "").strip()
    if text == "0":
        return None
    if text and text != "1":
        return Path(text).expanduser()
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sexpgpu"


def _positive_int(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() else None


def _nodes(environ: Mapping[str, str]) -> int:
    text = environ.get("SEXPGPU_NODES", "")
    if not text.strip():
        return 1
    nodes = _positive_int(text)
    if nodes is None or nodes < 1:
        raise SexpgpuError(
            "E-DP-005",
            f"SEXPGPU_NODES={_quote(text)} is not a node count",
            "SEXPGPU_NODES",
            hint="set SEXPGPU_NODES to a whole number of nodes, 1 or more, such as "
            "SEXPGPU_NODES=2, or unset it to run on one node",
        )
    return nodes


def _node_rank(environ: Mapping[str, str], nodes: int) -> int:
    text = environ.get("SEXPGPU_NODE_RANK", "")
    numbering = f"number the nodes 0 to {nodes - 1}, 0 on the node that listens at " + (
        "SEXPGPU_RENDEZVOUS"
    )
    if not text.strip():
        if nodes > 1:
            raise SexpgpuError(
                "E-DP-005",
                f"SEXPGPU_NODE_RANK is not set, but SEXPGPU_NODES={nodes}",
                "SEXPGPU_NODE_RANK",
                hint=f"set SEXPGPU_NODE_RANK on each node: {numbering}",
            )
        return 0
    rank = _positive_int(text)
    if rank is None:
        raise SexpgpuError(
            "E-DP-005",
            f"SEXPGPU_NODE_RANK={_quote(text)} is not a node rank",
            "SEXPGPU_NODE_RANK",
            hint=f"set SEXPGPU_NODE_RANK to a whole number: {numbering}",
        )
    if rank >= nodes:
        raise SexpgpuError(
            "E-DP-005",
            f"SEXPGPU_NODE_RANK={rank} is out of range for SEXPGPU_NODES={nodes}",
            "SEXPGPU_NODE_RANK",
            hint=numbering,
        )
    return rank


def _rendezvous(environ: Mapping[str, str], nodes: int) -> tuple[str, int] | None:
    text = environ.get("SEXPGPU_RENDEZVOUS", "")
    example = "such as SEXPGPU_RENDEZVOUS=10.0.0.1:29500, the address node 0 listens at"
    if not text.strip():
        if nodes > 1:
            raise SexpgpuError(
                "E-DP-005",
                f"SEXPGPU_RENDEZVOUS is not set, but SEXPGPU_NODES={nodes}",
                "SEXPGPU_RENDEZVOUS",
                hint=f"set SEXPGPU_RENDEZVOUS=host:port on every node, {example}",
            )
        return None
    host, _, port_text = text.strip().rpartition(":")
    port = _positive_int(port_text)
    if not host or port is None or not 1 <= port <= 65535:
        raise SexpgpuError(
            "E-DP-005",
            f"SEXPGPU_RENDEZVOUS={_quote(text)} is not host:port with a port from 1 to 65535",
            "SEXPGPU_RENDEZVOUS",
            hint=f"write host:port, {example}",
        )
    return host.strip("[]"), port


def _node_gradients(environ: Mapping[str, str]) -> str:
    text = environ.get("SEXPGPU_NODE_GRADIENTS", "")
    dtype = text.strip().lower() or "bf16"
    if dtype not in NODE_GRADIENT_DTYPES:
        raise SexpgpuError(
            "E-DP-005",
            f"SEXPGPU_NODE_GRADIENTS={_quote(text)} is not a gradient dtype",
            "SEXPGPU_NODE_GRADIENTS",
            hint="use bf16 (the default: half the traffic; each rounding error is carried to "
            "the next step) or f32 (two nodes of one GPU train bitwise like one node of two)",
        )
    return dtype


def _node_timeout(environ: Mapping[str, str]) -> float:
    text = environ.get("SEXPGPU_NODE_TIMEOUT", "")
    if not text.strip():
        return NODE_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise SexpgpuError(
            "E-DP-005",
            f"SEXPGPU_NODE_TIMEOUT={_quote(text)} is not a number of seconds",
            "SEXPGPU_NODE_TIMEOUT",
            hint=f"give the seconds a node waits for the others, such as "
            f"SEXPGPU_NODE_TIMEOUT=600, or unset it for {NODE_TIMEOUT:g}",
        )
    return seconds
