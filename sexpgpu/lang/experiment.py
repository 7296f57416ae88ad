"""An experiment: a file read, its forms checked, its variant applied.

`load_experiment` is the one entry point for the layers above: it reads the
file, dispatches each top-level form through `SPECIAL_FORMS` in its stage,
and returns a frozen `Experiment` with every setting evaluated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from types import MappingProxyType

from sexpgpu.errors import SexpgpuError, Source, Span
from sexpgpu.lang import data as _data  # noqa: F401  (registers defdata)
from sexpgpu.lang import runs as _runs  # noqa: F401  (registers defrun)
from sexpgpu.lang.definitions import DataDef, FnDef, ModelDef, RunDef
from sexpgpu.lang.forms import SPECIAL_FORMS, Builder, SpecialForm, resolve_params
from sexpgpu.lang.reader import load_text, read_source
from sexpgpu.lang.suggest import options_hint
from sexpgpu.lang.syntax import ListNode, Node, Symbol, describe
from sexpgpu.lang.values import Value

__all__ = ["Experiment", "load_experiment", "load_experiment_text", "parse_sets"]

_STAGES = 3


@dataclass(frozen=True)
class Experiment:
    """Everything one experiment file defines, with the chosen variant applied.

    Attributes
    ----------
    path
        The file (or the name given to `load_experiment_text`).
    source
        The text, for error excerpts.
    variant
        The chosen variant, or None.
    params
        Parameter name -> value after the variant, in definition order.
    data, functions, models, runs
        Definitions by name, in definition order.
    defaults
        Parameter values without any variant.
    overridden
        The parameters the variant sets explicitly.
    variants
        The names of every variant the file defines.
    param_spans
        Where each parameter is defined.
    sets
        The ``--set`` overrides: parameter name -> its value (after the variant).
    """

    path: Path
    source: Source
    variant: str | None
    params: Mapping[str, Value]
    data: Mapping[str, DataDef]
    functions: Mapping[str, FnDef]
    models: Mapping[str, ModelDef]
    runs: Mapping[str, RunDef]
    defaults: Mapping[str, Value] = field(default_factory=dict)
    overridden: frozenset[str] = frozenset()
    variants: tuple[str, ...] = ()
    param_spans: Mapping[str, Span] = field(default_factory=dict)
    sets: Mapping[str, Value] = field(default_factory=dict)

    def run(self, name: str | None = None) -> RunDef:
        """The run called `name`; without a name, the only run of the file.

        Raises
        ------
        SexpgpuError
            E-FORM-006 when `name` is unknown, or when no name is given and
            the file defines no run or several.
        """
        if name is None:
            if len(self.runs) == 1:
                return next(iter(self.runs.values()))
            if not self.runs:
                hint = "add (defrun NAME :model M :data D :loss L :optimizer O :batch B :steps N)"
                raise SexpgpuError("E-FORM-006", "the experiment defines no run", self._where, hint)
            raise SexpgpuError(
                "E-FORM-006",
                f"the experiment defines {len(self.runs)} runs; choose one",
                self._where,
                hint=f"pass --run NAME; runs: {', '.join(self.runs)}",
            )
        if name not in self.runs:
            raise SexpgpuError(
                "E-FORM-006",
                f"unknown run `{name}`",
                self._where,
                hint=options_hint(name, self.runs, "runs"),
            )
        return self.runs[name]

    @property
    def _where(self) -> str:
        return self.source.name


def load_experiment(
    path: str | PathLike[str], variant: str | None = None, sets: Sequence[str] = ()
) -> Experiment:
    """Read and check an experiment file.

    Parameters
    ----------
    path
        A UTF-8 ``.lisp`` file. Data paths in it are relative to its folder.
    variant
        A variant the file defines (``defvariant``), or None for the defaults.
    sets
        ``--set NAME=VALUE`` texts: parameter values after the variant, each
        checked against the parameter's type as a variant's value is.

    Returns
    -------
    Experiment
        Every definition, with parameters evaluated and the variant applied.

    Raises
    ------
    SexpgpuError
        E-READ-* for text that does not read, E-FORM-* for forms that do not
        check, at the offending span.
    """
    path = Path(path)
    text = load_text(path)
    return load_experiment_text(text, str(path), variant, base_dir=path.parent, sets=sets)


def load_experiment_text(
    text: str,
    name: str = "<string>",
    variant: str | None = None,
    base_dir: str | PathLike[str] | None = None,
    sets: Sequence[str] = (),
) -> Experiment:
    """Check experiment `text` as `load_experiment` checks a file.

    Parameters
    ----------
    text
        Experiment text.
    name
        What errors call the text (a path, usually).
    variant
        A variant the text defines, or None.
    base_dir
        The folder data paths are relative to (default: the current folder).
    sets
        ``--set NAME=VALUE`` texts (see `load_experiment`).
    """
    source = Source(name, text)
    builder = Builder(source, Path(base_dir) if base_dir is not None else Path(), variant)
    builder.sets.update(parse_sets(sets))
    _run_forms(read_source(source), builder)
    return Experiment(
        path=Path(name),
        source=source,
        variant=variant,
        params=MappingProxyType(builder.params),
        data=MappingProxyType(builder.data),
        functions=MappingProxyType(builder.functions),
        models=MappingProxyType(builder.models),
        runs=MappingProxyType(builder.runs),
        defaults=MappingProxyType(builder.defaults),
        overridden=frozenset(builder.overridden),
        variants=tuple(builder.variants),
        param_spans=MappingProxyType({s.name: s.span for s, _ in builder.param_decls}),
        sets=MappingProxyType({name: builder.params[name] for name in builder.sets}),
    )


def parse_sets(texts: Sequence[str]) -> dict[str, tuple[Symbol, Node]]:
    """``NAME=VALUE`` texts -> name -> (the name, the value's syntax), in order.

    The value is read as the language reads a parameter's value, so
    ``--set lr=3e-4``, ``--set dtype='"f32"'`` and ``--set lr='(/ lr 10)'`` work.

    Raises
    ------
    SexpgpuError
        E-CLI-001 for a text without ``=``, a name given twice, or a value
        that is not one expression; E-READ-* for a value that does not read.
    """
    out: dict[str, tuple[Symbol, Node]] = {}
    for text in texts:
        name, eq, value = text.partition("=")
        nodes = read_source(Source("--set", f"{name} {value}")) if eq and name.strip() else ()
        if len(nodes) != 2 or not isinstance(nodes[0], Symbol) or name != name.strip():
            raise SexpgpuError(
                "E-CLI-001",
                f"--set {text!r} is not NAME=VALUE with one value",
                "--set",
                hint="write --set NAME=VALUE, e.g. --set lr=3e-4 or --set dtype='\"f32\"'",
            )
        if nodes[0].name in out:
            raise SexpgpuError(
                "E-CLI-001",
                f"--set {nodes[0].name} is given twice",
                "--set",
                hint=f"give each parameter once; keep the --set {nodes[0].name}=... you mean",
            )
        out[nodes[0].name] = (nodes[0], nodes[1])
    return out


def _run_forms(nodes: Sequence[Node], builder: Builder) -> None:
    """Dispatch each top-level form to its handler, stage by stage."""
    stages: list[list[tuple[SpecialForm, ListNode]]] = [[] for _ in range(_STAGES)]
    for node in nodes:
        form = _special_form(node)
        stages[form.stage].append((form, node))
    for stage, forms in enumerate(stages):
        for form, node in forms:
            form.handler(node, builder)
        if stage == 0:
            resolve_params(builder)


def _special_form(node: Node) -> SpecialForm:
    names = SPECIAL_FORMS
    if not isinstance(node, ListNode) or not node.items or not isinstance(node.items[0], Symbol):
        raise SexpgpuError(
            "E-FORM-001",
            f"expected a top-level form such as (defparams ...), found {describe(node)}",
            node.span,
            hint=f"top-level forms: {', '.join(names)}",
        )
    head = node.items[0]
    if head.name not in names:
        raise SexpgpuError(
            "E-FORM-001",
            f"unknown top-level form `{head.name}`",
            head.span,
            hint=options_hint(head.name, names, "top-level forms"),
        )
    return names[head.name]
