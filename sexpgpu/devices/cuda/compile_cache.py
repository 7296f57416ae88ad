"""The compiled-step cache: a training step compiled once on a machine loads at the next run.

A cold step costs our trace of the IR to aten calls, Inductor's compile
and Triton's (tens of seconds for GPT-2 small). The cache keeps both sides
in one folder (`sexpgpu.runtime.config.cache_dir`: ``$XDG_CACHE_HOME/sexpgpu``,
``SEXPGPU_CACHE``):

- ``steps/<key>.step``: our entry for a traced step (`StepCache`): the
  rewritten aten graph as `sexpgpu.devices.cuda.compile_worker.pack_graph`
  bytes (or the split step's parts and how they connect), its inputs'
  metadata, each graph's key in AOTAutograd's cache, and what the trace
  decided (parameters read from bf16 copies, the kernels' IR nodes). A run
  that finds it skips the trace;
- ``plans/<key>.plan``: what planning derived from the training graph at
  each stacking degree (`plan_key`; `sexpgpu.devices.cuda.planner`): its
  live set, products' FLOPs and node count. A run that finds it stacks and
  schedules only the degree it chooses;
- ``inductor/`` and ``triton/``: Inductor's FX graph and AOTAutograd
  caches and Triton's kernels (``TORCHINDUCTOR_CACHE_DIR`` and
  ``TRITON_CACHE_DIR``, pointed here when the device opens). The entry's
  graphs are loaded from there by their keys
  (`sexpgpu.devices.cuda.inductor_keys`): the generated code is loaded,
  not generated, and its key is not computed again. A graph whose key finds
  nothing is compiled from the entry's graph (a hit there where Inductor
  still holds its code), and its key noted anew.

The key (`step_key`) is a digest of what the trace depends on: the graph's
text after the variant and stacking (no spans), its outputs summed and how,
the device and its capability, the libraries' versions, sexpgpu's own
sources, and the process settings that change the numerics. Nothing in it
is timed, so equal keys give the same kernels and the same bits.

Entries are written to a file of their own and renamed into place, so runs
that share the folder never see half an entry; each holds a digest of its
contents, and an entry that fails it (cut short, overwritten) is ignored
and compiled again. The partial file of a save cut short by a kill is
removed when the cache next opens. Deleting the folder costs a compile,
nothing else.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import pickle
import platform
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sexpgpu.runtime.files import remove_stale_partials, replace_whole

__all__ = ["FORMAT", "StepCache", "kept_bytes", "open_cache", "plan_key", "step_key"]

log = logging.getLogger(__name__)

# Bumped when an entry's layout changes: older entries are then simply not found.
FORMAT = 1
_MAGIC = b"sexpgpu-step\n"


# Each kind of entry: its folder and its files' suffix.
_KINDS = {"step": ("steps", ".step"), "plan": ("plans", ".plan")}


class StepCache:
    """The traced steps kept in `root` (``root/steps``), the plans' numbers beside
    (``root/plans``), and the libraries' caches.

    Parameters
    ----------
    root
        The cache's folder; made when the first entry is saved.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        for folder, _ in _KINDS.values():  # saves cut short by a kill
            remove_stale_partials(self.root / folder)

    @property
    def inductor_dir(self) -> Path:
        return self.root / "inductor"

    @property
    def triton_dir(self) -> Path:
        return self.root / "triton"

    def _path(self, key: str, kind: str) -> Path:
        folder, suffix = _KINDS[kind]
        return self.root / folder / f"{key}{suffix}"

    def load(self, key: str, kind: str = "step") -> dict[str, Any] | None:
        """The entry of `kind` saved under `key`, or None: absent, damaged, or of another format."""
        path = self._path(key, kind)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        head = len(_MAGIC) + 64
        digest = data[len(_MAGIC) : head].decode("ascii", "replace")
        body = data[head:]
        if not data.startswith(_MAGIC) or hashlib.sha256(body).hexdigest() != digest:
            log.warning("compile cache: %s is damaged; made again", path)
            return None
        try:
            entry = pickle.loads(body)
        except Exception as error:  # a pickle of another version's classes, say
            log.warning("compile cache: %s does not load (%s); made again", path, error)
            return None
        if not isinstance(entry, dict) or entry.get("format") != FORMAT:
            return None
        return entry

    def save(self, key: str, entry: Mapping[str, Any], kind: str = "step") -> None:
        """Keep `entry` of `kind` under `key`, whole or not at all, whatever other runs do."""
        path = self._path(key, kind)
        body = pickle.dumps({**entry, "format": FORMAT}, protocol=pickle.HIGHEST_PROTOCOL)
        data = _MAGIC + hashlib.sha256(body).hexdigest().encode("ascii") + body
        try:
            replace_whole(path, data)
        except OSError as error:  # a cache that cannot be written costs a compile next time
            log.warning("compile cache: %s not saved (%s)", path, error)


def kept_bytes(value: Any) -> int | None:
    """A byte count an entry kept (a measured peak), or None where it holds anything else."""
    return value if type(value) is int and value >= 0 else None


def open_cache(environ: Mapping[str, str]) -> StepCache | None:
    """The cache `environ` names (None: ``SEXPGPU_CACHE=0``), with Inductor's and Triton's in it.

    The libraries read their folders from the environment when they first
    compile, and compile workers inherit it: so it is set here, when the
    device opens, before either has run.
    """
    from sexpgpu.runtime.config import cache_dir

    root = cache_dir(environ)
    if root is None:
        return None
    cache = StepCache(root)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache.inductor_dir)
    os.environ["TRITON_CACHE_DIR"] = str(cache.triton_dir)
    return cache


def step_key(
    graph_text: str,
    device: Any,
    *,
    sums: tuple[str, ...],
    options: Mapping[str, Any],
    settings: Mapping[str, Any],
) -> str:
    """The digest that names a traced step's entry (see the module docstring)."""
    material = {
        "graph": hashlib.sha256(graph_text.encode()).hexdigest(),
        "sums": list(sums),
        "options": _texts(options),
    }
    return _digest(material, device, settings)


def plan_key(
    train_text: str, eval_text: str, device: Any, *, degrees: list[int], settings: Mapping[str, Any]
) -> str:
    """The digest that names a plan's entry: both graphs' text (no spans), the degrees, the device.

    The settings are the process's (`compile_worker.settings`): the lowering
    the schedules plan may change with determinism.
    """
    material = {
        "train": hashlib.sha256(train_text.encode()).hexdigest(),
        "eval": hashlib.sha256(eval_text.encode()).hexdigest(),
        "degrees": list(degrees),
    }
    return _digest(material, device, settings)


def _digest(material: Mapping[str, Any], device: Any, settings: Mapping[str, Any]) -> str:
    """A key of `material`, the device, the process's settings, the libraries' versions
    (sexpgpu's sources too) and the environment's settings of the compilers."""
    facts = {"device": _device_facts(device), "versions": _versions(), "env": _compiler_env()}
    text = json.dumps({**material, **facts, "settings": _texts(settings)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:40]


# The compilers' variables that say where their files go, or how many processes compile.
_WHERE_OR_HOW_FAST = {
    "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_CACHE_DIR",
    "TORCHINDUCTOR_COMPILE_THREADS",
}


def _compiler_env() -> dict[str, str]:
    """Inductor's and Triton's settings from the environment (``TORCHINDUCTOR_MAX_AUTOTUNE``...).

    They change the code compiled: a step's code is loaded by its key in
    AOTAutograd's cache without that key being computed again
    (`sexpgpu.devices.cuda.inductor_keys`), so this key must differ instead.
    """
    prefixes = ("TORCHINDUCTOR_", "TORCH_COMPILE_", "TRITON_")
    return {
        k: v
        for k, v in sorted(os.environ.items())
        if k.startswith(prefixes) and k not in _WHERE_OR_HOW_FAST
    }


def _texts(values: Mapping[str, Any]) -> dict[str, str]:
    return {k: repr(v) for k, v in sorted(values.items())}


def _device_facts(device: Any) -> dict[str, Any]:
    """The device as the trace sees it: its index too (the graph's calls name it).

    On the CPU, the vector instructions it has (``AVX512``): Inductor's C++
    is built for them, and a step's code is loaded without Inductor asking.
    """
    import torch

    facts: dict[str, Any] = {"device": str(device), "machine": platform.machine()}
    if device.type == "cpu":
        facts["vectors"] = torch.backends.cpu.get_cpu_capability()
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        facts["name"] = torch.cuda.get_device_name(index)
        facts["capability"] = list(torch.cuda.get_device_capability(index))
    return facts


@functools.cache
def _versions() -> dict[str, Any]:
    """The libraries' versions and a digest of sexpgpu's sources (they change unversioned)."""
    import torch

    import sexpgpu

    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "python": list(sys.version_info[:3]),
        "sexpgpu": sexpgpu.__version__,
        "sources": _sources_digest(Path(sexpgpu.__file__).parent),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "triton": triton,
    }


def _sources_digest(package: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()
