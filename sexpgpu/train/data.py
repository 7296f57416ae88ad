"""Data sources and loaders: what a `defdata` form yields per microbatch.

A *source* turns a `DataDef` into a data set: a token stream (``bytes``,
``tokens``, ``python-stdlib``) or named sample arrays (``arrays``,
``digits``). A *loader* cuts a data set into microbatches for one rank.

Everything a loader yields is a pure function of the run's seed and a global
microbatch index, so a loader's position is one integer (the optimizer steps
consumed) and a resume continues exactly where the run stopped::

    step s, microbatches M, ranks R, rank r
    global microbatch g = s*M + r*(M/R) + j      for j in 0 .. M/R-1

The `DataDef` comes from the language (`sexpgpu.lang.data`), which holds the
source names, options and defaults: every option is filled in and checked
there, so a source here only opens and reads.

Token streams: the first ``split`` of the stream trains, the rest evaluates.
Training windows of ``seq + 1`` tokens start at random offsets drawn from
``default_rng([seed, g])``; evaluation uses consecutive windows from the
start of the eval part, the same ones every time. Every training microbatch
also carries its random key (``#dropout-key``, a hash of the seed and ``g``:
`sexpgpu.ir.counter_rng`), so dropout's masks follow the same rule. Sample arrays: a seeded
permutation splits the samples; training walks a fresh permutation of the
training samples each epoch; evaluation walks the eval samples in order,
wrapping around to fill the last batch.
"""

from __future__ import annotations

import functools
import os
import sysconfig
import zipfile
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from sexpgpu.errors import SexpgpuError
from sexpgpu.ir.counter_rng import KEY_FIELD, microbatch_key
from sexpgpu.ir.trace_data import NpyMember, npz_members, read_npy_header
from sexpgpu.lang.paths import file_problem
from sexpgpu.runtime.units import format_bytes
from sexpgpu.train.settings import microbatches_per_rank

__all__ = [
    "SOURCES",
    "TOKEN_DTYPES",
    "ArrayLoader",
    "ArraySet",
    "Loader",
    "StreamLoader",
    "TokenStream",
    "make_loader",
    "python_stdlib_bytes",
    "source",
]

# `:dtype` of a `tokens` file (the language's TOKEN_DTYPES) -> its NumPy dtype
TOKEN_DTYPES = {"u16": np.dtype("<u2"), "u32": np.dtype("<u4")}


@dataclass(frozen=True)
class TokenStream:
    """A flat stream of integer tokens (often a read-only `np.memmap`)."""

    tokens: np.ndarray
    seq: int
    split: float
    where: str
    layout: str = ""  # how the file was read, e.g. "llm.c token file, version 1, u16"


@dataclass(frozen=True)
class ArraySet:
    """Named arrays whose first axis is the sample."""

    fields: Mapping[str, np.ndarray]
    split: float
    where: str


DataSet = TokenStream | ArraySet

# name as users type it (the language's table) -> function(DataDef) -> DataSet
SOURCES: dict[str, Callable[[Any], DataSet]] = {}


def source(name: str) -> Callable[[Callable[[Any], DataSet]], Callable[[Any], DataSet]]:
    """Register a data source under the name users write in `defdata`."""

    def register(fn: Callable[[Any], DataSet]) -> Callable[[Any], DataSet]:
        SOURCES[name] = fn
        return fn

    return register


def _existing_file(data: Any) -> Path:
    """The data set's file, when it is a regular file with something in it."""
    problem = file_problem(data.path)
    if problem is not None:
        # A folder, a FIFO or a device may be there, but none can be read as data: say which.
        what, hint = problem
        raise SexpgpuError(
            "E-DATA-001", f"data set `{data.name}`: {data.path} {what}", str(data.path), hint=hint
        )
    path = Path(data.path)
    if path.stat().st_size == 0:
        raise SexpgpuError(
            "E-DATA-002",
            f"data set `{data.name}`: file {path} is empty",
            str(path),
            hint="point `defdata` at a file with data in it",
        )
    return path


@source("bytes")
def _bytes(data: Any) -> TokenStream:
    return _token_file(data, _existing_file(data), np.dtype(np.uint8), "u8")


@source("tokens")
def _tokens(data: Any) -> TokenStream:
    path = _existing_file(data)
    header = _llmc_header(data, path)
    if header is not None:
        return header
    name = data.options["dtype"]
    return _token_file(data, path, TOKEN_DTYPES[name], name)


# llm.c's token files: 256 little-endian int32 (magic, version, token count, zeros),
# then the tokens; version 1 holds u16 ids (GPT-2), version 2 u32 ids (Llama 3).
LLMC_MAGIC = 20240520
LLMC_HEADER_BYTES = 256 * 4
LLMC_VERSIONS = {1: "u16", 2: "u32"}


def _llmc_header(data: Any, path: Path) -> TokenStream | None:
    """The tokens of an llm.c token file, or None when `path` has no llm.c header."""
    if path.stat().st_size < LLMC_HEADER_BYTES:
        return None
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(LLMC_HEADER_BYTES), dtype="<i4")
    if int(header[0]) != LLMC_MAGIC:
        return None
    version, count = int(header[1]), int(header[2])
    if count == 0 and version in LLMC_VERSIONS:
        raise SexpgpuError(
            "E-DATA-002",
            f"data set `{data.name}`: {path} is an llm.c token file of no tokens",
            str(path),
            hint="point `defdata` at a file with tokens in it",
        )
    if version not in LLMC_VERSIONS:
        raise SexpgpuError(
            "E-DATA-003",
            f"data set `{data.name}`: {path} is an llm.c token file of version {version}, "
            f"which sexpgpu does not read",
            str(path),
            hint="versions 1 (u16 ids) and 2 (u32 ids) are read",
        )
    name = LLMC_VERSIONS[version]
    dtype = TOKEN_DTYPES[name]
    size = path.stat().st_size
    if count < 0 or size != LLMC_HEADER_BYTES + count * dtype.itemsize:
        raise SexpgpuError(
            "E-DATA-003",
            f"data set `{data.name}`: {path}'s llm.c header says {count} {name} tokens, "
            f"but the file holds {size - LLMC_HEADER_BYTES} bytes after the header",
            str(path),
            hint="the file was cut off or altered; write it again",
        )
    tokens = np.memmap(path, dtype=dtype, mode="r", offset=LLMC_HEADER_BYTES, shape=(count,))
    layout = f"llm.c token file, version {version}, {count:,} {name} tokens"
    return TokenStream(tokens, data.options["seq"], data.options["split"], str(path), layout)


def _token_file(data: Any, path: Path, dtype: np.dtype, name: str) -> TokenStream:
    """A file of little-endian integer tokens without a header, memory-mapped."""
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise SexpgpuError(
            "E-DATA-003",
            f"data set `{data.name}`: {path} has {size} bytes, not a whole number of "
            f"{name} tokens ({dtype.itemsize} bytes each)",
            str(path),
            hint="check :dtype: the file was perhaps written as another integer width",
        )
    tokens = np.memmap(path, dtype=dtype, mode="r")
    layout = "" if name == "u8" else f"headerless, {len(tokens):,} {name} tokens"
    return TokenStream(tokens, data.options["seq"], data.options["split"], str(path), layout)


@functools.lru_cache(maxsize=1)
def python_stdlib_bytes() -> np.ndarray:
    """The running Python's standard-library ``.py`` files, concatenated.

    Files are taken in sorted relative-path order, skipping ``site-packages``,
    test directories and caches, so that the text is the same on every run of
    one Python. The result is cached in memory (about 12 MB for CPython 3.11).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    blob = b"".join(p.read_bytes() for p in files)
    out = np.frombuffer(blob, dtype=np.uint8)
    out.flags.writeable = False
    return out


@source("python-stdlib")
def _python_stdlib(data: Any) -> TokenStream:
    options = data.options
    return TokenStream(python_stdlib_bytes(), options["seq"], options["split"], "python-stdlib")


def _check_int32_range(value: np.ndarray, key: str, where: str, name: str) -> None:
    # Integers become int32; a cast of larger values would wrap silently.
    if value.dtype.kind == "b" or value.size == 0 or np.can_cast(value.dtype, np.int32):
        return
    low, high = int(value.min()), int(value.max())
    limits = np.iinfo(np.int32)
    if low < limits.min or high > limits.max:
        raise SexpgpuError(
            "E-DATA-003",
            f"data set `{name}`: field {key} of {where} holds integers from {low} to {high}, "
            "outside int32",
            where,
            hint="integer fields become int32: store ids and labels below 2**31",
        )


def _check_finite(value: np.ndarray, key: str, where: str, name: str) -> None:
    """E-DATA-007 when float data holds NaN or infinity (also past float32's range).

    Checked once at load: one NaN sample would make the training loss NaN, or
    an eval loss print ``nan`` while the run ends as if all were well.
    """
    bad = ~np.isfinite(value)
    if bad.any():
        count, first = int(bad.sum()), np.unravel_index(int(np.argmax(bad)), value.shape)
        raise SexpgpuError(
            "E-DATA-007",
            f"data set `{name}`: field {key} of {where} holds {count} NaN or infinite "
            f"value{'s' if count != 1 else ''}, the first at index {list(map(int, first))} "
            f"({value[first]})",
            where,
            hint="clean the data (drop or fill those samples); floats beyond float32's "
            "range become infinite",
        )


def _sample_arrays(raw: Mapping[str, np.ndarray], where: str, name: str) -> dict[str, np.ndarray]:
    out = {}
    for key, value in raw.items():
        if value.dtype.kind == "f":
            with np.errstate(over="ignore"):  # past float32's range: inf, refused below
                out[key] = value.astype(np.float32, copy=False)
            _check_finite(out[key], key, where, name)
        elif value.dtype.kind in "iub":
            _check_int32_range(value, key, where, name)
            out[key] = value.astype(np.int32, copy=False)
        else:
            raise SexpgpuError(
                "E-DATA-003",
                f"data set `{name}`: field {key} of {where} has dtype {value.dtype}",
                where,
                hint="store numeric arrays (floats or integers)",
            )
    lengths = {key: len(value) for key, value in out.items()}
    if len(set(lengths.values())) > 1:
        raise SexpgpuError(
            "E-DATA-004",
            f"data set `{name}`: the fields of {where} have different lengths {lengths}",
            where,
            hint="every field's first axis is the sample: give them one length",
        )
    return out


@source("arrays")
def _arrays(data: Any) -> ArraySet:
    path = _existing_file(data)
    members = npz_members(path, data.name, str(path))
    wanted = list(data.options["fields"])
    missing = [f for f in wanted if f not in members]
    if missing:
        raise SexpgpuError(
            "E-DATA-004",
            f"data set `{data.name}`: {path} has no field {', '.join(missing)}",
            str(path),
            hint=f"its fields are {', '.join(members) or 'none'}; fix :fields",
        )
    _check_fits_in_memory([members[f] for f in wanted], path, data.name)
    raw = _read_members(path, [members[f] for f in wanted], data.name)
    return ArraySet(_sample_arrays(dict(zip(wanted, raw, strict=True)), str(path), data.name),
                    data.options["split"], str(path))  # fmt: skip


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def _check_fits_in_memory(members: list[NpyMember], path: Path, name: str) -> None:
    """E-DATA-003 when the arrays would fill more than half of this machine's memory.

    The loader holds its arrays in memory, so a small compressed file that
    expands past the memory (an "npz bomb") is refused before it is read.
    """
    total, memory = sum(m.nbytes for m in members), _memory_bytes()
    if memory is not None and total > memory // 2:
        raise SexpgpuError(
            "E-DATA-003",
            f"data set `{name}`: the fields of {path} expand to {format_bytes(total)}, "
            f"more than half of this machine's {format_bytes(memory)} of memory",
            str(path),
            hint="the loader keeps `arrays` data in memory: use a smaller file, or a "
            "`tokens` file, which is memory-mapped",
        )


def _read_members(path: Path, members: list[NpyMember], name: str) -> list[np.ndarray]:
    """The arrays of `members`, read (and decompressed) from the .npz at `path`."""
    out = []
    try:
        with zipfile.ZipFile(path) as archive:
            for m in members:
                with archive.open(m.member) as handle:
                    read_npy_header(handle)  # checked by npz_members; now past it
                    raw = handle.read(m.nbytes)
                if len(raw) != m.nbytes:
                    raise ValueError(f"{m.member} ends after {len(raw)} of {m.nbytes} bytes")
                array = np.frombuffer(raw, dtype=m.dtype)
                out.append(array.reshape(m.shape, order="F" if m.fortran else "C"))
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error, ValueError) as err:
        raise SexpgpuError(
            "E-DATA-001",
            f"data set `{name}`: {path} is not a readable .npz file ({err})",
            str(path),
            hint="write it with numpy.savez",
        ) from None
    return out


@source("digits")
def _digits(data: Any) -> ArraySet:
    from sklearn.datasets import load_digits  # bundled with scikit-learn: no download

    bunch = load_digits()
    fields = {
        "x": (bunch.data / 16.0).astype(np.float32),  # pixels 0..16 -> [0, 1]
        "y": bunch.target.astype(np.int32),
    }
    return ArraySet(fields, data.options["split"], "digits")


class Loader(Protocol):
    """What the run loop needs of a loader."""

    fields: Mapping[str, tuple[tuple[int, ...], str]]
    items_per_microbatch: int
    item_unit: str  # what items_per_microbatch counts, as progress lines write it: tok, samples
    position: int

    layout: str  # what was read: the files, token layouts, the eval source

    def next_step(self) -> list[dict[str, np.ndarray]]: ...
    def eval_batches(self, count: int) -> list[dict[str, np.ndarray]]: ...
    def state(self) -> dict[str, int]: ...
    def restore(self, state: Mapping[str, int]) -> None: ...


class _Base:
    """Position bookkeeping shared by both loaders."""

    def __init__(self, batch: int, microbatches: int, seed: int, rank: int, ranks: int) -> None:
        self.share = microbatches_per_rank(microbatches, ranks)
        self.batch, self.microbatches, self.seed = batch, microbatches, seed
        self.rank, self.ranks = rank, ranks
        self.position = 0  # optimizer steps consumed

    def _global_indices(self) -> range:
        first = self.position * self.microbatches + self.rank * self.share
        return range(first, first + self.share)

    def next_step(self) -> list[dict[str, np.ndarray]]:
        """This rank's microbatches of the next optimizer step, each with its random key.

        The key (`KEY_FIELD`, from the seed and the global index) is what dropout's
        masks are drawn from; a graph without random ops never reads it.
        """
        out = [
            self._train(g) | {KEY_FIELD: microbatch_key(self.seed, g)}
            for g in self._global_indices()
        ]
        self.position += 1
        return out

    def state(self) -> dict[str, int]:
        """The position, JSON-able, with what it depends on."""
        return {"position": self.position, "rank": self.rank, "ranks": self.ranks}

    def restore(self, state: Mapping[str, int]) -> None:
        """Continue from `state` (see `state`); the rank layout must be the same."""
        if (state["rank"], state["ranks"]) != (self.rank, self.ranks):
            raise SexpgpuError(
                "E-DP-002",
                f"the checkpoint's loader is rank {state['rank']} of {state['ranks']}, "
                f"this run's is rank {self.rank} of {self.ranks}",
                "SEXPGPU_DEVICES",
                hint=f"resume on {state['ranks']} device(s), as the checkpoint was written",
            )
        self.position = int(state["position"])

    def _train(self, g: int) -> dict[str, np.ndarray]:
        raise NotImplementedError


class StreamLoader(_Base):
    """Windows of a token stream: fields ``tokens`` and ``next``, ``[batch, seq]`` int32."""

    def __init__(
        self, data: TokenStream, name: str, held: TokenStream | None = None, **layout: int
    ) -> None:
        super().__init__(**layout)
        self.seq = data.seq
        cut = int(len(data.tokens) * data.split)
        self._train_part, self._eval_part = data.tokens[:cut], data.tokens[cut:]
        parts = [(self._train_part, "training", data), (self._eval_part, "eval", data)]
        if held is not None:  # `:eval SOURCE`: evaluate on all of another stream
            self._eval_part = held.tokens
            parts[1] = (held.tokens, "eval", held)
        for part, label, whole in parts:
            if len(part) < self.seq + 1 and (label == "training" or whole.split < 1.0):
                raise SexpgpuError(
                    "E-DATA-002",
                    f"data set `{name}`: the {label} part of {whole.where} has {len(part)} "
                    f"tokens, fewer than :seq + 1 = {self.seq + 1}",
                    whole.where,
                    hint="use more data, a shorter :seq, or another :split",
                )
        self._name, self._where = name, data.where
        # What was read, for the run's records: which token file layout, which eval source.
        self.layout = ", ".join(
            f"{label}{s.where}" + (f" ({s.layout})" if s.layout else "")
            for label, s in (("", data), ("eval ", held))
            if s is not None
        )
        shape = (self.batch, self.seq)
        self.fields = {"tokens": (shape, "int32"), "next": (shape, "int32")}
        self.items_per_microbatch = self.batch * self.seq
        self.item_unit = "tok"

    def _windows(self, part: np.ndarray, starts: np.ndarray) -> dict[str, np.ndarray]:
        raw = part[starts[:, None] + np.arange(self.seq + 1)]
        if raw.dtype.itemsize >= 4 and raw.size and int(raw.max()) > np.iinfo(np.int32).max:
            # u32 ids past int32 would wrap to negative ones: name the real value instead.
            raise SexpgpuError(
                "E-DATA-003",
                f"data set `{self._name}`: {self._where} holds token id {int(raw.max())}, "
                "beyond int32",
                self._where,
                hint="token ids become int32: keep them below 2**31",
            )
        rows = raw.astype(np.int32)
        return {"tokens": rows[:, :-1], "next": rows[:, 1:]}  # (B, S) each

    def _train(self, g: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, g])
        starts = rng.integers(0, len(self._train_part) - self.seq, size=self.batch)
        return self._windows(self._train_part, starts)

    def eval_batches(self, count: int) -> list[dict[str, np.ndarray]]:
        """`count` batches of consecutive eval windows, the same ones every call."""
        windows = (len(self._eval_part) - 1) // self.seq
        out = []
        for k in range(count):
            index = (k * self.batch + np.arange(self.batch)) % windows
            out.append(self._windows(self._eval_part, index * self.seq))
        return out


class ArrayLoader(_Base):
    """Rows of named sample arrays, reshuffled every epoch."""

    def __init__(
        self, data: ArraySet, name: str, held: ArraySet | None = None, **layout: int
    ) -> None:
        super().__init__(**layout)
        count = len(next(iter(data.fields.values())))
        order = np.random.default_rng([self.seed, 0]).permutation(count)
        cut = round(count * data.split)
        self._train_rows, self._eval_rows = order[:cut], np.sort(order[cut:])
        if held is not None:  # `:eval SOURCE`: its samples follow the training ones
            data = _joined(data, held, name)
            self._eval_rows = np.arange(count, len(next(iter(data.fields.values()))))
            if not len(self._eval_rows):
                raise SexpgpuError(
                    "E-DATA-002",
                    f"data set `{name}`: the eval source {held.where} holds no samples",
                    held.where,
                    hint="give :eval a source with samples in it",
                )
        if len(self._train_rows) < 1 or (len(self._eval_rows) < 1 and data.split < 1.0):
            raise SexpgpuError(
                "E-DATA-002",
                f"data set `{name}`: {count} samples in {data.where} leave nothing to "
                f"train or to evaluate at :split {data.split}",
                data.where,
                hint="use more samples or another :split",
            )
        if len(self._train_rows) < self.batch:  # an epoch would repeat samples within a batch
            raise SexpgpuError(
                "E-DATA-002",
                f"data set `{name}`: :split {data.split} of {count} samples in {data.where} "
                f"leaves {len(self._train_rows)} to train, fewer than a batch of {self.batch}",
                data.where,
                hint=f"raise :split to {self.batch / count:.3g} or more, or lower :batch",
            )
        self._arrays = data.fields
        self._epochs: dict[int, np.ndarray] = {}
        self.fields = {
            k: ((self.batch, *v.shape[1:]), str(v.dtype)) for k, v in data.fields.items()
        }
        self.items_per_microbatch = self.batch
        self.item_unit = "samples"
        self.layout = data.where + ("" if held is None else f"; eval {held.where}")

    def _rows(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        return {k: np.ascontiguousarray(v[rows]) for k, v in self._arrays.items()}

    def _epoch(self, epoch: int) -> np.ndarray:
        if epoch not in self._epochs:
            if len(self._epochs) > 1:  # a microbatch spans two epochs at most
                self._epochs.pop(min(self._epochs))
            rng = np.random.default_rng([self.seed, 1, epoch])
            self._epochs[epoch] = rng.permutation(self._train_rows)
        return self._epochs[epoch]

    def _train(self, g: int) -> dict[str, np.ndarray]:
        places = g * self.batch + np.arange(self.batch)
        n = len(self._train_rows)
        rows = np.array([self._epoch(int(p // n))[p % n] for p in places])
        return self._rows(rows)

    def eval_batches(self, count: int) -> list[dict[str, np.ndarray]]:
        """`count` batches of the eval samples in order, wrapping around."""
        n = len(self._eval_rows)
        return [
            self._rows(self._eval_rows[(k * self.batch + np.arange(self.batch)) % n])
            for k in range(count)
        ]


def make_loader(
    data: Any,
    *,
    batch: int,
    microbatches: int = 1,
    seed: int = 0,
    rank: int = 0,
    ranks: int = 1,
) -> StreamLoader | ArrayLoader:
    """The loader of `data` (a `DataDef`) for one rank of a run.

    Parameters
    ----------
    data
        The language's `DataDef`: ``name``, ``kind`` (a key of `SOURCES`),
        ``path``, ``options`` (every one filled in: ``seq``, ``split``,
        ``dtype``, ``fields``).
    batch
        Rows per microbatch.
    microbatches
        Microbatches per optimizer step over all ranks; must divide by `ranks`.
    seed
        The run's seed: split, windows and shuffles follow from it.
    rank, ranks
        Which share of every step this loader yields.
    """
    layout = {"batch": batch, "microbatches": microbatches, "seed": seed}
    layout |= {"rank": rank, "ranks": ranks}
    dataset = SOURCES[data.kind](data)
    held = None if data.eval is None else SOURCES[data.eval.kind](data.eval)
    if isinstance(dataset, TokenStream):
        return StreamLoader(dataset, data.name, held, **layout)  # type: ignore[arg-type]
    return ArrayLoader(dataset, data.name, held, **layout)  # type: ignore[arg-type]


def _joined(train: ArraySet, held: ArraySet, name: str) -> ArraySet:
    """The samples of `train` then those of `held` (E-DATA-004 unless their fields agree)."""
    for key, value in train.fields.items():
        other = held.fields.get(key)
        if other is None or other.shape[1:] != value.shape[1:] or other.dtype != value.dtype:
            found = "no such field" if other is None else f"{other.dtype} {list(other.shape[1:])}"
            raise SexpgpuError(
                "E-DATA-004",
                f"data set `{name}`: field {key} of the eval source {held.where} is {found}, "
                f"the training source's is {value.dtype} {list(value.shape[1:])}",
                held.where,
                hint="evaluate on samples of the training samples' fields and shapes",
            )
    fields = {k: np.concatenate([v, held.fields[k]]) for k, v in train.fields.items()}
    return ArraySet(fields, train.split, train.where)
