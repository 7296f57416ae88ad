"""What the host offers: Python, NumPy, PyTorch, CUDA, the driver and the GPUs.

`probe` gathers the facts that ``sexpgpu doctor`` checks; it imports PyTorch
when PyTorch is installed (that is what it looks at) and never fails: what it
cannot find it reports as missing, with the reason.
"""

from __future__ import annotations

import importlib.util
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["GpuFacts", "HostFacts", "probe"]


@dataclass(frozen=True)
class GpuFacts:
    """One visible GPU."""

    index: int
    name: str
    capability: tuple[int, int]
    memory: int  # bytes


@dataclass(frozen=True)
class HostFacts:
    """The versions and devices found on this host (None: not found).

    Attributes
    ----------
    cuda_problem
        Why CUDA cannot be used, when it cannot ("PyTorch is a CPU build", ...).
    """

    python: tuple[int, int, int]
    numpy: str | None = None
    torch: str | None = None
    torch_cuda: str | None = None
    cuda_problem: str | None = None
    driver: str | None = None
    cudnn: str | None = None
    nccl: str | None = None
    gpus: tuple[GpuFacts, ...] = field(default_factory=tuple)

    @property
    def python_text(self) -> str:
        """The Python version as ``3.11.7``."""
        return ".".join(map(str, self.python))


def probe() -> HostFacts:
    """Look at the host: versions of Python, NumPy, PyTorch, CUDA, and the GPUs."""
    facts: dict[str, object] = {"python": tuple(sys.version_info[:3])}
    if importlib.util.find_spec("numpy") is not None:
        import numpy

        facts["numpy"] = numpy.__version__
    facts["driver"] = _driver_version()
    if importlib.util.find_spec("torch") is None:
        facts["cuda_problem"] = "PyTorch is not installed"
        return HostFacts(**facts)  # type: ignore[arg-type]
    facts.update(_torch_facts())
    return HostFacts(**facts)  # type: ignore[arg-type]


def _torch_facts() -> dict[str, object]:
    import torch

    facts: dict[str, object] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
    if torch.version.cuda is None:
        facts["cuda_problem"] = f"PyTorch {torch.__version__} is a CPU build, without CUDA"
        return facts
    try:
        available = torch.cuda.is_available()
    except Exception as err:  # a broken driver can raise here
        available = False
        facts["cuda_problem"] = f"CUDA does not start: {err}"
    if not available:
        facts.setdefault("cuda_problem", "CUDA sees no GPU (driver missing, or none visible)")
        return facts
    facts["cudnn"] = _version_text(torch.backends.cudnn.version())
    try:
        facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # NCCL is absent from some builds
        facts["nccl"] = None
    facts["gpus"] = tuple(_gpu(torch, i) for i in range(torch.cuda.device_count()))
    return facts


def _gpu(torch: object, index: int) -> GpuFacts:
    props = torch.cuda.get_device_properties(index)  # type: ignore[attr-defined]
    return GpuFacts(index, props.name, (props.major, props.minor), int(props.total_memory))


def _version_text(version: int | None) -> str | None:
    """cuDNN's integer version (90100) as ``9.1.0``."""
    if version is None:
        return None
    major, rest = divmod(version, 10000) if version >= 10000 else divmod(version, 1000)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}.{patch}"


def _driver_version() -> str | None:
    """The NVIDIA driver's version, from /proc or nvidia-smi; None without one."""
    proc = Path("/proc/driver/nvidia/version")
    if proc.exists():
        for word in proc.read_text(errors="replace").split():
            if word[:1].isdigit() and word.count(".") >= 1:
                return word
    if platform.system() == "Linux" and shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None
    return None
