"""The memory plan of one sweep: tiles, working sets, and where environments live.

The plan is made before any site is read, from the shapes alone::

    tiles        columns per left-to-right product, projected rows per
                 right-to-left block: fixed by the problem (each tile's
                 intermediates stay under TILE_BYTES), never by the budgets
    working set  per rank, the most one site of either pass holds at once
                 (cores and the next site's prefetch, the environment in and
                 out, the sketch, its QR, the projected environment, a tile,
                 and what one product may hold beyond its operands: the
                 double copies of a widened complex64 product on a GPU)
    tiers        each stored environment on the device, in (pinned) host
                 memory, or on disk under scratch_dir, first come first served
    resident     on a GPU, the input sites whose cores stay on the device
                 between the passes, in what the environments leave (else
                 the right-to-left pass reads and uploads them again)

Because the tiles do not depend on the budgets, every budget runs the same
products in the same order: the result is the same bit for bit, and a budget
only decides what is kept and what is recomputed or spilled. A budget smaller
than the working set is a `MemoryError` saying by how much.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

import numpy as np

from sexpgpu.runtime.units import MiB, format_bytes

from .contractions import env_peak_per_column
from .trains import Stack

__all__ = [
    "TILE_BYTES",
    "Budgets",
    "Plan",
    "column_blocks",
    "make_plan",
    "minimum_budgets",
    "row_blocks",
]

# The intermediates of one tile of sketch columns or projected rows.
TILE_BYTES = 256 * MiB

Tier = str  # "device", "host" or "disk"


@dataclass(frozen=True)
class Budgets:
    """Bytes the sweep may use, and the names users set them by.

    Attributes
    ----------
    device : int
        Per rank: device memory (``gpu_memory``), or host memory for a host
        backend (then equal to ``host``).
    host : int
        Host memory for all ranks together (``host_memory``).
    device_name, host_name : str
        The argument to raise, for messages (``"gpu_memory"``, ``"host_memory"``).
    device_source : str
        Where ``device`` came from (``"Resources"`` or ``"detected"``).
    shared : bool
        Whether device and host are one memory (NumPy, or PyTorch on the CPU).
    """

    device: int
    host: int
    device_name: str
    host_name: str
    device_source: str
    shared: bool


@dataclass(frozen=True)
class Plan:
    """How one sweep uses memory; logged at DEBUG before the sweep starts.

    Attributes
    ----------
    ranks : int
        Devices the sketch columns are split over.
    blocks : tuple of (int, int)
        Each rank's contiguous block of sketch columns.
    env_tile : int
        Sketch columns per left-to-right product.
    row_tile : int
        Projected rows per right-to-left block.
    hold_z : bool
        Whether each right-to-left site keeps its block ``Z`` for the projection
        (else it computes it again, tile by tile).
    work_device : int
        The planned peak per rank on the device, environments not counted.
    work_host : int
        The planned host working set (reads, staging, output cores).
    tiers : tuple of tuple of str
        Per rank, the tier of environments ``C_1 .. C_{n-1}``.
    env_bytes : dict
        Bytes of environments per tier, all ranks together.
    budgets : Budgets
        The budgets planned against.
    resident : frozenset of int
        Sites whose cores the left-to-right pass keeps on every rank's device.
    resident_bytes : int
        Their bytes, per rank.
    """

    ranks: int
    blocks: tuple[tuple[int, int], ...]
    env_tile: int
    row_tile: int
    hold_z: bool
    work_device: int
    work_host: int
    tiers: tuple[tuple[Tier, ...], ...]
    env_bytes: dict[str, int]
    budgets: Budgets
    resident: frozenset[int] = frozenset()
    resident_bytes: int = 0

    def line(self) -> str:
        """One line for the log: tiles, working sets, tiers, budgets."""
        tiers = ", ".join(f"{t} {format_bytes(n)}" for t, n in self.env_bytes.items() if n)
        z = "held" if self.hold_z else "recomputed"
        return (
            f"ranks={self.ranks}, env batch={self.env_tile}, "
            f"projected rows per block={self.row_tile}, Z {z}, "
            f"working set {format_bytes(self.work_device)} per rank of "
            f"{format_bytes(self.budgets.device)} ({self.budgets.device_name}, "
            f"{self.budgets.device_source}), host working set {format_bytes(self.work_host)} of "
            f"{format_bytes(self.budgets.host)}, environments: {tiers or 'none'}, "
            f"input cores kept between the passes: {len(self.resident)} sites "
            f"({format_bytes(self.resident_bytes)} per rank)"
        )


def column_blocks(size: int, ranks: int) -> tuple[tuple[int, int], ...]:
    """Split ``size`` sketch columns into ``ranks`` contiguous blocks, the first ones larger."""
    base, extra = divmod(size, ranks)
    bounds, lo = [], 0
    for r in range(ranks):
        hi = lo + base + (1 if r < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return tuple(bounds)


def row_blocks(n: int, tile: int) -> list[tuple[int, int]]:
    """``[0, n)`` in tiles of ``tile`` (the last may be shorter; none when n=0)."""
    return [(lo, min(lo + tile, n)) for lo in range(0, n, tile)]


def _site_sizes(stack: Stack, j: int) -> tuple[int, int, int, int]:
    """``(lefts, rights, up*down, elements of the cores)`` of site ``j``."""
    shapes = stack.shapes(j)
    lefts = prod(s[0] for s in shapes)
    rights = prod(s[1] for s in shapes)
    return lefts, rights, shapes[0][2] * shapes[-1][3], sum(prod(s) for s in shapes)


def _ltr_elements(stack: Stack, j: int, cols: int, tile_work: int) -> int:
    lefts, rights, ud, cores = _site_sizes(stack, j)
    # this site's cores and the next one's prefetch, C_j and C_{j+1}, omega, a tile
    return 2 * cores + cols * (lefts + rights + ud) + tile_work


def _rtl_elements(
    stack: Stack,
    j: int,
    size: int,
    cols: int,
    caps: Sequence[int],
    root: bool,
    tile_work: int,
    wide: int,
) -> tuple[int, int]:
    """A right-to-left site's elements, and what holding its ``Z`` adds to them."""
    lefts, rights, ud, cores = _site_sizes(stack, j)
    e = 1 if j == stack.n_sites - 1 else min(size, caps[j])
    rows = e * ud
    c = min(size, rows, caps[j - 1]) if j > 0 else 1
    held = 2 * cores + cols * lefts + e * rights + rows * cols + 2 * c * lefts
    if root:  # the gathered sketch, kept until its QR is checked
        held += rows * size + _qr_elements(rows, size, c, wide)
    # a tile of intermediates makes Z's blocks; held, they stay for the projection
    return held + tile_work, rows * lefts


def _qr_elements(rows: int, size: int, c: int, wide: int) -> int:
    """Beside the sketch: the larger of its CholeskyQR2 and of ``Q``, the core and ``Q^H``.

    CholeskyQR2 (`sexpgpu.tn.cholqr`) holds a widened copy of the sketch,
    ``Q1`` and ``Q2`` and four Gram-sized matrices (``R``, an SVD's ``U``
    beside them), each ``wide`` elements of the work dtype apiece (2 when a
    single-precision sketch is factored in double). Householder QR, its
    fallback, runs after those are freed and needs less.
    """
    copy = wide if wide > 1 else 0
    factor = (copy + 2 * wide) * rows * size + (4 * wide + 2) * size * size
    return max(factor, 3 * c * rows)


def _working_sets(
    stack: Stack,
    size: int,
    blocks: Sequence[tuple[int, int]],
    tile_work: int,
    wide: int,
) -> tuple[int, int]:
    """Elements the busiest rank holds at once, environments in store not counted.

    Returns ``(lean, full)``: recomputing each site's ``Z`` for the
    projection, and holding it (`Plan.hold_z`); one pass over the sites.
    """
    caps = stack.cut_ranks
    cols = max(hi - lo for lo, hi in blocks)
    ltr = max(_ltr_elements(stack, j, cols, tile_work) for j in range(stack.n_sites - 1))
    lean, full = ltr, ltr
    for j in range(stack.n_sites):
        rtl, z = _rtl_elements(stack, j, size, cols, caps, True, tile_work, wide)
        lean, full = max(lean, rtl), max(full, rtl + z)
    return lean, full


def _host_working_set(stack: Stack, size: int, item: int) -> int:
    """Host bytes beside the device's: two sites as read, one staged, output cores, omega."""
    caps = stack.cut_ranks
    per_site = []
    for j in range(stack.n_sites):
        _lefts, _rights, ud, _cores = _site_sizes(stack, j)
        read = sum(
            prod(s) * np.dtype(layer.sites[j].dtype).itemsize
            for s, layer in zip(stack.shapes(j), stack.layers, strict=True)
        )
        e = 1 if j == stack.n_sites - 1 else min(size, caps[j])
        out = min(size, e * ud) * e * ud * item
        # output cores: one downloading into page-locked memory, one being
        # copied out of it by the writer, and its copy (`sink.CoreWriter`)
        per_site.append(3 * read + 3 * out + size * ud * 16)
    return max(per_site)


def _qr_widening(work: np.dtype) -> int:
    """2 where the sketch's QR runs in double for a single-precision ``work`` (`.cholqr`)."""
    return 2 if np.finfo(work).bits < 64 else 1


def _memory_error(what: str, need: int, budget: int, name: str, source: str) -> MemoryError:
    over = need - budget
    return MemoryError(
        f"src: the {what} working set needs {format_bytes(need)} ({need} B) but the "
        f"{name} budget is {format_bytes(budget)} ({budget} B, {source}): it exceeds the "
        f"budget by {format_bytes(over)} ({over} B); raise Resources({name}=...) to at least "
        f"{need} B, use a smaller chi_out or oversample, or split over more devices."
    )


def make_plan(
    stack: Stack,
    size: int,
    work: np.dtype,
    ranks: int,
    budgets: Budgets,
    product_slack: int = 0,
) -> Plan:
    """Plan one sweep of ``size`` sketch columns over ``ranks`` devices.

    ``product_slack`` is what one product may hold beyond its operands and
    result on a rank (`Backend.product_slack`): counted in the device's
    working set.

    Raises
    ------
    MemoryError
        The working set exceeds the device or host budget; the message says by how much.
    """
    item = work.itemsize
    blocks, tile, tile_work, wide = _tiling(stack, size, work, ranks)
    lean, full = (
        n * item + product_slack for n in _working_sets(stack, size, blocks, tile_work, wide)
    )
    host_work = _host_working_set(stack, size, item)
    device_budget = budgets.device
    if budgets.shared:
        # One memory: the host's own share comes out of it too.
        device_budget = budgets.device - host_work
    if lean > device_budget:
        name = budgets.device_name
        need = lean + (host_work if budgets.shared else 0)
        raise _memory_error(
            "device" if not budgets.shared else "host",
            need,
            budgets.device,
            name,
            budgets.device_source,
        )
    if not budgets.shared and host_work > budgets.host:
        raise _memory_error("host", host_work, budgets.host, budgets.host_name, "host memory")
    hold_z = full <= device_budget
    work_device = full if hold_z else lean
    tiers, env_bytes = _tiers(stack, blocks, item, device_budget - work_device, budgets, host_work)
    resident, resident_bytes = frozenset[int](), 0
    if not budgets.shared:
        pairs = zip(blocks, tiers, strict=True)
        envs = max(_tier_bytes(stack, block, item, mine, "device") for block, mine in pairs)
        resident, resident_bytes = _resident(stack, item, device_budget - work_device - envs)
    return Plan(
        ranks=ranks,
        blocks=blocks,
        env_tile=tile,
        row_tile=tile,
        hold_z=hold_z,
        work_device=work_device,
        work_host=host_work,
        tiers=tiers,
        env_bytes=env_bytes,
        budgets=budgets,
        resident=resident,
        resident_bytes=resident_bytes,
    )


def _env_bytes(stack: Stack, j: int, cols: int, item: int) -> int:
    """Bytes of ``cols`` columns of environment ``C_j``."""
    return cols * prod(s[0] for s in stack.shapes(j)) * item


def _tier_bytes(
    stack: Stack, block: tuple[int, int], item: int, tiers: Sequence[Tier], tier: Tier
) -> int:
    """Bytes of one rank's environments in ``tier``."""
    cols = block[1] - block[0]
    return sum(_env_bytes(stack, j, cols, item) for j, t in enumerate(tiers, start=1) if t == tier)


def _resident(stack: Stack, item: int, room: int) -> tuple[frozenset[int], int]:
    """The sites of the left-to-right pass whose cores fit in ``room`` bytes, first first.

    Every rank holds every site's whole cores, so one set serves all ranks.
    Kept cores are read, staged and uploaded once instead of twice: the host's
    copy into page-locked memory was what held the passes back. Only a device
    keeps them: on the host a site is read again at no more than the cost of
    its read (in-memory arrays are not copied; files stay lazy).
    """
    kept, used = [], 0
    for j in range(stack.n_sites - 1):
        nbytes = sum(prod(s) for s in stack.shapes(j)) * item
        if used + nbytes <= room:
            kept.append(j)
            used += nbytes
    return frozenset(kept), used


def _tiers(
    stack: Stack,
    blocks: Sequence[tuple[int, int]],
    item: int,
    device_left: int,
    budgets: Budgets,
    host_work: int,
) -> tuple[tuple[tuple[Tier, ...], ...], dict[str, int]]:
    """Environments to the device while it has room, then host memory, then disk."""
    first = "host" if budgets.shared else "device"
    host_left = 0 if budgets.shared else max(0, budgets.host - host_work)
    host_share = host_left // len(blocks)
    totals = {first: 0, "host": 0, "disk": 0}
    tiers = []
    for lo, hi in blocks:
        dev, host, mine = device_left, host_share, []
        for j in range(1, stack.n_sites):
            nbytes = _env_bytes(stack, j, hi - lo, item)
            if nbytes <= dev:
                tier, dev = first, dev - nbytes
            elif nbytes <= host:
                tier, host = "host", host - nbytes
            else:
                tier = "disk"
            totals[tier] += nbytes
            mine.append(tier)
        tiers.append(tuple(mine))
    return tuple(tiers), totals


def minimum_budgets(
    stack: Stack, size: int, work: np.dtype, ranks: int = 1, product_slack: int = 0
) -> tuple[int, int]:
    """The smallest ``(device, host)`` budgets `make_plan` accepts, in bytes.

    The device's is the lean working set (no sketch held whole); on a host
    backend (one memory) the smallest budget is their sum.
    """
    item = work.itemsize
    blocks, _tile, tile_work, wide = _tiling(stack, size, work, ranks)
    lean, _full = _working_sets(stack, size, blocks, tile_work, wide)
    return lean * item + product_slack, _host_working_set(stack, size, item)


def _tiling(
    stack: Stack, size: int, work: np.dtype, ranks: int
) -> tuple[tuple[tuple[int, int], ...], int, int, int]:
    """The ranks' column blocks, the tile's columns and working elements, the QR's widening."""
    per_line = max(env_peak_per_column(stack.shapes(j)) for j in range(stack.n_sites))
    tile = int(min(size, max(1, TILE_BYTES // (per_line * work.itemsize))))
    return column_blocks(size, ranks), tile, tile * per_line, _qr_widening(work)
