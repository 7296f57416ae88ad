"""``defdata``: data sets, and the registry of the sources they read.

`SOURCES` maps the source names users type (``bytes``, ``tokens``,
``arrays``, ``digits``, ``python-stdlib``) to what each takes: a path or
not, its own options, and the fields a microbatch holds. Stream sources
(bytes, tokens, python-stdlib) need ``:seq`` and yield ``tokens`` and
``next``. Nothing is opened here: the loader in `sexpgpu.train` reads the
data; this layer only checks the definition and resolves the path against
the experiment file. It is the one table of source names, their options and
defaults (`DEFAULT_SPLIT`, `TOKEN_DTYPES`); the loader's sources are keyed by
the same names and check nothing again (tests/test_names.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from sexpgpu.errors import SexpgpuError
from sexpgpu.lang.definitions import DataDef
from sexpgpu.lang.forms import Builder, KeyArgs, form_name, keyword_args, special_form
from sexpgpu.lang.suggest import options_hint
from sexpgpu.lang.syntax import ListNode, Literal, Node, Symbol, Vector, describe, unparse
from sexpgpu.lang.values import Value, choice, integer, number, show_value, string

__all__ = ["DEFAULT_SPLIT", "SOURCES", "STREAM_FIELDS", "TOKEN_DTYPES", "DataSource"]

DEFAULT_SPLIT = 0.9
STREAM_FIELDS = ("tokens", "next")
# `:dtype` of a `tokens` file: little-endian unsigned ids, the first the default
# (nanoGPT's and llm.c's token files are u16; u32 holds vocabularies past 65536).
TOKEN_DTYPES = ("u16", "u32")

OptionsReader = Callable[[KeyArgs, Mapping[str, Value], str], dict[str, Any]]


@dataclass(frozen=True)
class DataSource:
    """A kind of data: whether it takes a path, its options, the fields it yields."""

    name: str
    usage: str
    takes_path: bool = False
    suffix: str | None = None
    stream: bool = False
    keys: tuple[str, ...] = ()
    fields: tuple[str, ...] | None = None  # None: given by the source's :fields
    read_options: OptionsReader = field(default=lambda args, env, where: {})


SOURCES: dict[str, DataSource] = {}


def _register(source: DataSource) -> None:
    SOURCES[source.name] = source


def _tokens_options(args: KeyArgs, env: Mapping[str, Value], where: str) -> dict[str, Any]:
    if "dtype" not in args:
        return {"dtype": TOKEN_DTYPES[0]}
    return {"dtype": choice(args["dtype"][1], env, f"`:dtype` of {where}", TOKEN_DTYPES)}


def _arrays_options(args: KeyArgs, env: Mapping[str, Value], where: str) -> dict[str, Any]:
    node = args["fields"][1]
    if not isinstance(node, Vector) or not node.items:
        raise SexpgpuError(
            "E-FORM-005",
            f"`:fields` of {where} must be a vector of names, found {describe(node)}",
            node.span,
            hint="write :fields [x y], naming arrays of the .npz file",
        )
    names: list[str] = []
    for item in node.items:
        if not isinstance(item, Symbol):
            raise SexpgpuError(
                "E-FORM-005",
                f"`:fields` of {where} holds names, found {describe(item)}",
                item.span,
                hint="write :fields [x y]",
            )
        if item.name in names:
            raise SexpgpuError(
                "E-FORM-004",
                f"field `{item.name}` is named twice in {where}",
                item.span,
                hint="name each array once",
            )
        names.append(item.name)
    return {"fields": tuple(names)}


_register(DataSource("bytes", "(bytes PATH)", takes_path=True, stream=True, fields=STREAM_FIELDS))
_register(
    DataSource(
        "tokens",
        "(tokens PATH :dtype u16)",
        takes_path=True,
        stream=True,
        keys=("dtype",),
        fields=STREAM_FIELDS,
        read_options=_tokens_options,
    )
)
_register(
    DataSource(
        "arrays",
        "(arrays PATH.npz :fields [x y])",
        takes_path=True,
        suffix=".npz",
        keys=("fields",),
        read_options=_arrays_options,
    )
)
_register(DataSource("digits", "(digits)", fields=("x", "y")))
_register(DataSource("python-stdlib", "(python-stdlib)", stream=True, fields=STREAM_FIELDS))


@special_form("defdata", 1, "(defdata NAME SOURCE :seq S :split F :eval SOURCE)")
def _defdata(form: ListNode, builder: Builder) -> None:
    name = form_name(form, "data set", "(defdata NAME SOURCE :key value...)")
    where = f"data `{name.name}`"
    if len(form.items) < 3:
        raise SexpgpuError(
            "E-FORM-002",
            f"{where} needs a source",
            form.span,
            hint=f"sources: {', '.join(s.usage for s in SOURCES.values())}",
        )
    source, path, options = _source(form.items[2], builder, where)
    args = keyword_args(form.items[3:], ("seq", "split", "eval"), where)
    env = builder.params
    if source.stream and "seq" not in args:
        raise SexpgpuError(
            "E-FORM-003",
            f"{where} needs `:seq`: a stream is cut into rows of :seq tokens",
            form.span,
            hint=f"write (defdata {name.name} {source.usage} :seq 256)",
        )
    if not source.stream and "seq" in args:
        streams = ", ".join(s.name for s in SOURCES.values() if s.stream)
        raise SexpgpuError(
            "E-FORM-003",
            f"`:seq` does not apply to `{source.name}` in {where}",
            args["seq"][0].span,
            hint=f"only streams ({streams}) are cut into rows; remove :seq",
        )
    if source.stream:
        options["seq"] = integer(args["seq"][1], env, f"`:seq` of {where}", minimum=1)
    split = 1.0 if "eval" in args else DEFAULT_SPLIT  # a separate eval source: train on all
    if "split" in args and "eval" in args:
        raise SexpgpuError(
            "E-FORM-003",
            f"{where} gives both `:split` and `:eval`: the eval source replaces the split",
            args["split"][0].span,
            hint="remove :split to train on all of the source and evaluate on :eval",
        )
    if "split" in args:
        what = f"`:split` of {where}"
        split = number(args["split"][1], env, what, low=0.0, high=1.0, open_low=True)
    options["split"] = split
    if source.fields is not None:
        options["fields"] = source.fields
    evaluation = None
    if "eval" in args:
        evaluation = _eval_source(args["eval"][1], source, options, builder, name.name)
    builder.data[builder.claim(name, "data set")] = DataDef(
        name.name, source.name, path, MappingProxyType(options), form.span, evaluation
    )


def _eval_source(
    node: Node, train: DataSource, options: dict[str, Any], builder: Builder, name: str
) -> DataDef:
    """The data set of ``:eval SOURCE``: a source of the same fields, read whole."""
    where = f"`:eval` of data `{name}`"
    source, path, own = _source(node, builder, where)
    own.update({k: options[k] for k in ("seq", "fields") if k in options})
    own["split"] = 0.0  # all of it evaluates
    fields = source.fields if source.fields is not None else own.get("fields")
    if source.stream != train.stream or fields != options.get("fields"):
        raise SexpgpuError(
            "E-FORM-005",
            f"{where} is ({source.name} ...), which gives other fields than ({train.name} ...)",
            node.span,
            hint=f"evaluate on a source of the same fields, e.g. :eval {train.usage}",
        )
    return DataDef(f"{name}:eval", source.name, path, MappingProxyType(own), node.span)


def _source(node: Node, builder: Builder, where: str) -> tuple[DataSource, Path | None, dict]:
    """The source call of a defdata: its kind, resolved path and options."""
    usages = ", ".join(s.usage for s in SOURCES.values())
    if isinstance(node, Literal) and isinstance(node.value, str):
        raise SexpgpuError(
            "E-FORM-005",
            f"the source of {where} must be a call such as (bytes PATH), found {describe(node)}",
            node.span,
            hint=f"write (bytes {unparse(node)}); sources: {usages}",
        )
    if not (isinstance(node, ListNode) and node.items and isinstance(node.items[0], Symbol)):
        raise SexpgpuError(
            "E-FORM-005",
            f"the source of {where} must be a call such as (bytes PATH), found {describe(node)}",
            node.span,
            hint=f"sources: {usages}",
        )
    head = node.items[0]
    source = SOURCES.get(head.name)
    if source is None:
        raise SexpgpuError(
            "E-FORM-006",
            f"unknown data source `{head.name}`",
            head.span,
            hint=options_hint(head.name, SOURCES, "sources"),
        )
    rest = node.items[1:]
    path = None
    if source.takes_path:
        path = _source_path(source, node, builder, where)
        rest = rest[1:]
    if rest and not source.keys:
        raise SexpgpuError(
            "E-FORM-002",
            f"`{source.name}` takes no {'more ' if path else ''}arguments, "
            f"found {describe(rest[0])}",
            rest[0].span,
            hint=f"write {source.usage}",
        )
    args = keyword_args(rest, source.keys, f"({source.name} ...)")
    if "fields" in source.keys and "fields" not in args:
        raise SexpgpuError(
            "E-FORM-003",
            f"`{source.name}` in {where} needs `:fields`",
            node.span,
            hint=f"write {source.usage}",
        )
    return source, path, source.read_options(args, builder.params, where)


def _source_path(source: DataSource, node: ListNode, builder: Builder, where: str) -> Path:
    """The file a source such as ``(bytes PATH)`` names, relative to the experiment file."""
    rest = node.items[1:]
    if not rest or not isinstance(rest[0], Literal | Symbol):
        raise SexpgpuError(
            "E-FORM-002",
            f"`{source.name}` needs a path in {where}",
            node.span,
            hint=f"write {source.usage}; paths are relative to the experiment file",
        )
    text = string(rest[0], builder.params, f"the path of {where}")
    if "://" in text or not text:
        raise SexpgpuError(
            "E-FORM-005",
            f"the path of {where} must name a local file, found {show_value(text)}",
            rest[0].span,
            hint="data paths are files relative to the experiment file; copy remote data "
            "next to it",
        )
    if source.suffix and not text.endswith(source.suffix):
        raise SexpgpuError(
            "E-FORM-005",
            f"`{source.name}` reads a {source.suffix} file, found {show_value(text)}",
            rest[0].span,
            hint=f"write {source.usage}",
        )
    return builder.base_dir / text
