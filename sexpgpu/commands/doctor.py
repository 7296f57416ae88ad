"""`sexpgpu doctor`: check that this host meets the floor for a device.

The floor for ``cpu`` is Python 3.11 or newer and NumPy; for ``cuda`` also
PyTorch with CUDA, GPUs of compute capability 8.0 or newer, and valid
``SEXPGPU_*`` variables. Every check prints what was found and, when something
is missing, how to fix it; the exit status is 1 when the floor is not met.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Mapping
from dataclasses import astuple, dataclass

from sexpgpu.errors import SexpgpuError
from sexpgpu.runtime.config import ENV_VARS, RuntimeConfig, check_env
from sexpgpu.runtime.devices import MIN_CAPABILITY
from sexpgpu.runtime.memory import detect_budget
from sexpgpu.runtime.probe import GpuFacts, HostFacts, probe
from sexpgpu.runtime.units import format_bytes

__all__ = ["Check", "add_arguments", "checks", "main"]

_TORCH_FIX = (
    "install a CUDA build of PyTorch on the GPU machine, such as "
    "`pip install 'sexpgpu[cuda]' --extra-index-url https://download.pytorch.org/whl/cu126`"
)


@dataclass(frozen=True)
class Check:
    """One line of the report: ``ok``, ``info`` (not needed here) or ``FAIL``."""

    status: str
    name: str
    found: str
    fix: str = ""


DESCRIPTION = """\
Check that this machine meets the floor for a device: Python and NumPy for
cpu; PyTorch with CUDA, GPUs of compute capability 8.0 or newer and valid
SEXPGPU_* variables for cuda. Each check says what was found and how to fix
what is missing; the exit status is 1 when the floor is not met."""

EPILOG = """\
examples:
  sexpgpu doctor --device cpu
  sexpgpu doctor --device cuda      (SEXPGPU_DEVICES=0,1 checks those two GPUs)"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `sexpgpu doctor`."""
    parser.add_argument(
        "--device",
        default=None,
        metavar="DEVICE",
        help="the device to check the floor for: cpu or cuda (default: SEXPGPU_DEVICE, else cpu)",
    )


def main(args: argparse.Namespace) -> int:
    """Print every check; exit status 1 when the floor for the device is not met."""
    device = args.device
    found = checks(os.environ, device, probe())
    kind = _chosen_device(os.environ, device)
    _print(found, kind)
    failed = [c for c in found if c.status == "FAIL"]
    if failed:
        print(f"the {kind} floor is not met: fix the {len(failed)} FAIL line(s) above")
        return 1
    print(f"the {kind} floor is met")
    return 0


def checks(environ: Mapping[str, str], device: str | None, facts: HostFacts) -> list[Check]:
    """The report's lines for the chosen device, from the host's facts.

    Parameters
    ----------
    environ
        The environment (the ``SEXPGPU_*`` variables are checked).
    device
        The ``--device`` argument, or None.
    facts
        What `sexpgpu.runtime.probe.probe` found.
    """
    kind = _chosen_device(environ, device)
    cuda = kind == "cuda"
    needed = "FAIL" if cuda else "info"
    out = [_python(facts), _numpy(facts), *_torch(facts, needed)]
    problems = check_env(environ, device, visible_gpus=len(facts.gpus))
    selected = _selected(environ, device, len(facts.gpus)) if cuda and not problems else None
    out += [_gpu(gpu, needed, selected) for gpu in facts.gpus]
    if facts.torch_cuda and facts.gpus:
        out.append(_library("cuDNN", facts.cudnn, "attention falls back to the plain lowering"))
        several = cuda and environ.get("SEXPGPU_NODES", "1").strip() not in ("", "1")
        nccl = _library("NCCL", facts.nccl, "runs over several nodes are not possible")
        out.append(Check("FAIL", *astuple(nccl)[1:]) if several and not facts.nccl else nccl)
    out += _variables(environ, device, problems)
    if not problems:
        out.append(_devices(environ, device, len(facts.gpus)))
    return out


def _chosen_device(environ: Mapping[str, str], device: str | None) -> str:
    text = device if device is not None else environ.get("SEXPGPU_DEVICE", "")
    return "cuda" if text.strip().lower() == "cuda" else "cpu"


def _python(facts: HostFacts) -> Check:
    if facts.python[:2] >= (3, 11):
        return Check("ok", "Python", facts.python_text)
    return Check("FAIL", "Python", facts.python_text, "use Python 3.11 or newer")


def _numpy(facts: HostFacts) -> Check:
    if facts.numpy:
        return Check("ok", "NumPy", facts.numpy)
    return Check("FAIL", "NumPy", "not installed", "pip install numpy")


def _torch(facts: HostFacts, needed: str) -> list[Check]:
    if facts.torch is None:
        return [Check(needed, "PyTorch", "not installed (needed by cuda only)", _TORCH_FIX)]
    out = [Check("ok", "PyTorch", facts.torch)]
    if facts.cuda_problem:
        out.append(Check(needed, "CUDA", facts.cuda_problem, _TORCH_FIX))
    else:
        out.append(Check("ok", "CUDA", f"{facts.torch_cuda} (PyTorch's build)"))
    driver = facts.driver or "not found"
    out.append(Check("ok" if facts.driver else "info", "driver", driver))
    return out


def _gpu(gpu: GpuFacts, needed: str, selected: tuple[int, ...] | None) -> Check:
    major, minor = gpu.capability
    found = f"{gpu.name}, capability {major}.{minor}, {format_bytes(gpu.memory)}"
    if gpu.capability >= MIN_CAPABILITY:
        return Check("ok", f"GPU {gpu.index}", found)
    in_use = selected is not None and gpu.index in selected
    return Check(
        needed if in_use else "info",
        f"GPU {gpu.index}",
        f"{found}: the cuda device needs capability 8.0 or newer",
        "use a GPU of the Ampere generation or later, or leave this one out of SEXPGPU_DEVICES",
    )


def _library(name: str, version: str | None, without: str) -> Check:
    if version:
        return Check("ok", name, version)
    return Check("info", name, f"not found: {without}", "use a PyTorch build that ships it")


def _variables(
    environ: Mapping[str, str], device: str | None, problems: list[SexpgpuError]
) -> list[Check]:
    by_location = {str(err.location): err for err in problems}
    out = []
    if device is not None:
        err = by_location.pop("--device", None)
        out.append(_variable("--device", device, err))
    for name in ENV_VARS:
        err = by_location.pop(name, None)
        if name in environ or err is not None:
            out.append(_variable(name, environ.get(name, ""), err))
    return out + [_variable(str(e.location), "", e) for e in by_location.values()]


def _variable(name: str, value: str, err: SexpgpuError | None) -> Check:
    if err is None:
        return Check("ok", name, value)
    return Check("FAIL", name, f"error[{err.code}]: {err.message}", err.hint or "")


def _selected(environ: Mapping[str, str], device: str | None, visible: int) -> tuple[int, ...]:
    return RuntimeConfig.from_env(environ, device, visible_gpus=visible).devices


def _devices(environ: Mapping[str, str], device: str | None, visible: int) -> Check:
    config = RuntimeConfig.from_env(environ, device, visible_gpus=visible)
    ranks = ", ".join(map(str, config.local_devices))
    if config.simulated:
        ranks += f" ({config.local_size} ranks simulated on the host)"
    if config.nodes > 1:
        ranks += f"; node {config.node_rank} of {config.nodes}"
    budget = detect_budget(config.local_devices[0], config.memory)
    return Check("ok", "devices", f"{ranks}; memory budget {budget}")


def _print(found: list[Check], kind: str) -> None:
    title = f"sexpgpu doctor: the {kind} device"
    if sys.stdout.isatty() and importlib.util.find_spec("rich") is not None:
        _print_rich(found, title)
        return
    print(title)
    width = max(len(c.name) for c in found)
    for check in found:
        print(f"  {check.status:<4}  {check.name:<{width}}  {check.found}")
        if check.fix and check.status != "ok":
            print(f"  {'':<4}  {'':<{width}}  fix: {check.fix}")


def _print_rich(found: list[Check], title: str) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in ("", "check", "found", "fix"):
        table.add_column(column)
    style = {"ok": "green", "info": "yellow", "FAIL": "bold red"}
    for c in found:
        status = f"[{style[c.status]}]{c.status}[/]"
        table.add_row(status, escape(c.name), escape(c.found), escape(c.fix))
    Console().print(table)
