"""Top-level forms: a registry keyed by the form's name, and the forms that define names.

`SPECIAL_FORMS` maps ``defparams``, ``defvariant``, ``defn``, ``defmodel``,
``defdata`` and ``defrun`` to handlers, registered with `special_form`. A
handler checks its form and records what it defines in a `Builder`, the
state of one load. Forms run in stages, whatever their order in the file:

0. ``defparams`` and ``defvariant``; then the parameters are evaluated with
   the chosen variant applied (`resolve_params`);
1. ``defdata``, ``defn``, ``defmodel`` (their settings may use parameters);
2. ``defrun`` (it names data sets and models defined anywhere in the file).

Parameters, data sets, functions, models and runs share one namespace;
variants have their own, since they are chosen on the command line.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sexpgpu.errors import SexpgpuError, Source, Span
from sexpgpu.lang.definitions import DataDef, FnDef, ModelDef, RunDef
from sexpgpu.lang.suggest import options_hint
from sexpgpu.lang.syntax import Keyword, ListNode, Node, Symbol, Vector, describe
from sexpgpu.lang.values import Value, evaluate, show_value, type_name

__all__ = [
    "SPECIAL_FORMS",
    "Builder",
    "SpecialForm",
    "form_name",
    "keyword_args",
    "require_keys",
    "resolve_params",
    "special_form",
]

Handler = Callable[[ListNode, "Builder"], None]
KeyArgs = dict[str, tuple[Keyword, Node]]


@dataclass(frozen=True)
class SpecialForm:
    """A top-level form: its name, the stage it runs in, its handler and its usage line."""

    name: str
    stage: int
    handler: Handler
    usage: str


SPECIAL_FORMS: dict[str, SpecialForm] = {}


def special_form(name: str, stage: int, usage: str) -> Callable[[Handler], Handler]:
    """Register the decorated handler as the top-level form `name`."""

    def register(handler: Handler) -> Handler:
        SPECIAL_FORMS[name] = SpecialForm(name, stage, handler, usage)
        return handler

    return register


@dataclass(frozen=True)
class VariantDecl:
    """``(defvariant NAME (param value)...)`` before evaluation."""

    name: Symbol
    entries: tuple[tuple[Symbol, Node], ...]


@dataclass
class Builder:
    """What the forms of one file have defined so far (one per load; never shared)."""

    source: Source
    base_dir: Path
    variant: str | None
    # ``--set NAME=VALUE`` overrides, applied after the variant: name -> (name's span, value)
    sets: dict[str, tuple[Symbol, Node]] = field(default_factory=dict)
    param_decls: list[tuple[Symbol, Node]] = field(default_factory=list)
    variants: dict[str, VariantDecl] = field(default_factory=dict)
    params: dict[str, Value] = field(default_factory=dict)
    defaults: dict[str, Value] = field(default_factory=dict)
    overridden: set[str] = field(default_factory=set)
    data: dict[str, DataDef] = field(default_factory=dict)
    functions: dict[str, FnDef] = field(default_factory=dict)
    models: dict[str, ModelDef] = field(default_factory=dict)
    runs: dict[str, RunDef] = field(default_factory=dict)
    # every top-level name: what it is and where it was defined
    names: dict[str, tuple[str, Span]] = field(default_factory=dict)

    def claim(self, name: Symbol, kind: str) -> str:
        """Record `name` as a definition of `kind`; E-FORM-004 if already defined."""
        if name.name in self.names:
            other_kind, where = self.names[name.name]
            raise SexpgpuError(
                "E-FORM-004",
                f"duplicate definition of `{name.name}`",
                name.span,
                hint=f"`{name.name}` is already defined as a {other_kind} at "
                f"{where.line}:{where.col}; rename one of them",
            )
        self.names[name.name] = (kind, name.span)
        return name.name


# -- helpers for handlers ------------------------------------------------------------


def form_name(form: ListNode, kind: str, usage: str) -> Symbol:
    """The symbol naming a definition: the item after the form's head."""
    if len(form.items) < 2:
        raise SexpgpuError("E-FORM-002", f"{kind} needs a name", form.span, hint=f"write {usage}")
    name = form.items[1]
    if not isinstance(name, Symbol):
        raise SexpgpuError(
            "E-FORM-005",
            f"the name of a {kind} must be a symbol, found {describe(name)}",
            name.span,
            hint=f"write {usage}",
        )
    return name


def keyword_args(items: Sequence[Node], allowed: Collection[str], where: str) -> KeyArgs:
    """Pair ``:key value`` items, checking every key against `allowed`.

    Parameters
    ----------
    items
        The items after a form's name (or a call's head).
    allowed
        The valid key names, without colons.
    where
        What holds the keys, for messages (``"run `train`"``).

    Returns
    -------
    dict
        key name -> (the keyword node, the value node), in the written order.
    """
    args: KeyArgs = {}
    for i in range(0, len(items), 2):
        key = items[i]
        if not isinstance(key, Keyword):
            name = key.name if isinstance(key, Symbol) else ""
            raise SexpgpuError(
                "E-FORM-003",
                f"expected a key in {where}, found {describe(key)}",
                key.span,
                hint=options_hint(name, allowed, "keys", ":"),
            )
        if key.name not in allowed:
            raise SexpgpuError(
                "E-FORM-003",
                f"unknown key `:{key.name}` in {where}",
                key.span,
                hint=options_hint(key.name, allowed, "keys", ":"),
            )
        if key.name in args:
            first = args[key.name][0].span
            raise SexpgpuError(
                "E-FORM-004",
                f"`:{key.name}` is given twice in {where}",
                key.span,
                hint=f"it is first given at {first.line}:{first.col}; keep one",
            )
        if i + 1 == len(items):
            raise SexpgpuError(
                "E-FORM-002",
                f"`:{key.name}` has no value in {where}",
                key.span,
                hint=f"write :{key.name} VALUE",
            )
        args[key.name] = (key, items[i + 1])
    return args


def require_keys(args: KeyArgs, required: Sequence[str], form: Node, where: str) -> None:
    """E-FORM-003 at `form` if a key of `required` is missing from `args`."""
    missing = [key for key in required if key not in args]
    if missing:
        keys = " ".join(f":{key}" for key in missing)
        raise SexpgpuError(
            "E-FORM-003",
            f"{where} needs `:{missing[0]}`",
            form.span,
            hint=f"add {keys} (required: {', '.join(':' + k for k in required)})",
        )


def _entries(form: ListNode, start: int, what: str) -> tuple[tuple[Symbol, Node], ...]:
    """The ``(name value)`` entries of defparams/defvariant, checked for shape and repeats."""
    entries = []
    seen: dict[str, Span] = {}
    for entry in form.items[start:]:
        if not isinstance(entry, ListNode):
            raise SexpgpuError(
                "E-FORM-005",
                f"{what} entries are (name value) pairs, found {describe(entry)}",
                entry.span,
                hint="write (width 768)",
            )
        if len(entry.items) != 2:
            raise SexpgpuError(
                "E-FORM-002",
                f"a {what} entry takes a name and one value, found {len(entry.items)} items",
                entry.span,
                hint="write (name value); compute a value with an expression such as (* 4 width)",
            )
        name, value = entry.items
        if not isinstance(name, Symbol):
            raise SexpgpuError(
                "E-FORM-005",
                f"a parameter name must be a symbol, found {describe(name)}",
                name.span,
                hint="write (width 768)",
            )
        if name.name in seen:
            first = seen[name.name]
            raise SexpgpuError(
                "E-FORM-004",
                f"`{name.name}` is set twice in {what}",
                name.span,
                hint=f"it is first set at {first.line}:{first.col}; keep one",
            )
        seen[name.name] = name.span
        entries.append((name, value))
    return tuple(entries)


# -- parameters and variants ------------------------------------------------------


@special_form("defparams", 0, "(defparams (name value)...)")
def _defparams(form: ListNode, builder: Builder) -> None:
    for name, value in _entries(form, 1, "defparams"):
        builder.claim(name, "parameter")
        builder.param_decls.append((name, value))


@special_form("defvariant", 0, "(defvariant NAME (param value)...)")
def _defvariant(form: ListNode, builder: Builder) -> None:
    name = form_name(form, "variant", SPECIAL_FORMS["defvariant"].usage)
    if name.name in builder.variants:
        first = builder.variants[name.name].name.span
        raise SexpgpuError(
            "E-FORM-004",
            f"duplicate variant `{name.name}`",
            name.span,
            hint=f"variant `{name.name}` is already defined at {first.line}:{first.col}; "
            "merge them or rename one",
        )
    entries = _entries(form, 2, f"variant `{name.name}`")
    builder.variants[name.name] = VariantDecl(name, entries)


def resolve_params(builder: Builder) -> None:
    """Evaluate the parameters in order, applying the chosen variant.

    Every variant is checked to name only declared parameters, even the ones
    not chosen. A variant's value may be an expression of earlier parameters
    (after the variant), and the parameter's own name in it stands for the
    value it would have without the override, so ``(lr (/ lr 10))`` works.
    The value must have the type of that value, except that an integer may
    stand for a float.
    """
    names = [symbol.name for symbol, _ in builder.param_decls]
    for decl in builder.variants.values():
        for symbol, _ in decl.entries:
            if symbol.name not in builder.names or builder.names[symbol.name][0] != "parameter":
                raise SexpgpuError(
                    "E-FORM-006",
                    f"variant `{decl.name.name}` sets `{symbol.name}`, which is not a parameter",
                    symbol.span,
                    hint=options_hint(symbol.name, names, "parameters"),
                )
    for symbol, _ in builder.sets.values():
        if symbol.name not in names:
            raise SexpgpuError(
                "E-FORM-006",
                f"--set {symbol.name}: `{symbol.name}` is not a parameter",
                symbol.span,
                hint=options_hint(symbol.name, names, "parameters"),
            )
    builder.defaults.update(_evaluate_params(builder.param_decls, []))
    layers: list[tuple[str, dict[str, Node]]] = []
    if builder.variant is not None:
        decl = builder.variants.get(builder.variant)
        if decl is None:
            raise SexpgpuError(
                "E-FORM-006",
                f"unknown variant `{builder.variant}`",
                builder.source.name,
                hint=options_hint(builder.variant, builder.variants, "variants")
                if builder.variants
                else f"{builder.source.name} defines no variants; add "
                f"(defvariant {builder.variant} (param value)...)",
            )
        layers.append(("the variant", {symbol.name: value for symbol, value in decl.entries}))
    if builder.sets:
        layers.append(("--set", {name: value for name, (_, value) in builder.sets.items()}))
    builder.params.update(_evaluate_params(builder.param_decls, layers))
    for _, overrides in layers:
        builder.overridden.update(overrides)


def _evaluate_params(
    decls: Sequence[tuple[Symbol, Node]], layers: Sequence[tuple[str, dict[str, Node]]]
) -> dict[str, Value]:
    """Evaluate in order, each layer of overrides (the variant, then ``--set``) over the last.

    An override sees its parameter's own value as it would be without it.
    """
    env: dict[str, Value] = {}
    names = [symbol.name for symbol, _ in decls]
    for i, (symbol, expr) in enumerate(decls):
        later = names[i + 1 :]
        value = evaluate(expr, env, later)
        for who, overrides in layers:
            if symbol.name in overrides:
                node = overrides[symbol.name]
                new = evaluate(node, {**env, symbol.name: value}, later)
                value = _same_type(new, value, symbol.name, node, who)
        env[symbol.name] = value
    return env


def _same_type(value: Value, default: Value, name: str, node: Node, who: str) -> Value:
    if type(value) is type(default):
        return value
    if isinstance(default, float) and type(value) is int:
        return float(value)
    raise SexpgpuError(
        "E-FORM-005",
        f"`{name}` is {type_name(default, True)} ({show_value(default)} without {who}), "
        f"but {who} gives {type_name(value, True)} {show_value(value)}",
        node.span,
        hint=f"give `{name}` {type_name(default, True)}",
    )


# -- functions and models --------------------------------------------------------


def _function_parts(
    form: ListNode, kind: str, arg_kind: str
) -> tuple[Symbol, tuple[Symbol, ...], Node]:
    usage = f"({kind} NAME ({arg_kind[:-1]}...) body)"
    name = form_name(form, kind, usage)
    if len(form.items) < 3:
        raise SexpgpuError(
            "E-FORM-002",
            f"{kind} `{name.name}` needs its {arg_kind} and a body",
            form.span,
            hint=f"write {usage}",
        )
    arg_list = form.items[2]
    if not isinstance(arg_list, ListNode | Vector):
        raise SexpgpuError(
            "E-FORM-005",
            f"{kind} `{name.name}` needs a list of {arg_kind}, found {describe(arg_list)}",
            arg_list.span,
            hint=f"write {usage}",
        )
    args: list[Symbol] = []
    for arg in arg_list.items:
        if not isinstance(arg, Symbol):
            raise SexpgpuError(
                "E-FORM-005",
                f"{arg_kind} of `{name.name}` must be symbols, found {describe(arg)}",
                arg.span,
                hint=f"write {usage}",
            )
        if arg in args:
            raise SexpgpuError(
                "E-FORM-004",
                f"`{arg.name}` appears twice among the {arg_kind} of `{name.name}`",
                arg.span,
                hint="give each a different name",
            )
        args.append(arg)
    body = form.items[3:]
    if len(body) != 1:
        raise SexpgpuError(
            "E-FORM-002",
            f"{kind} `{name.name}` takes one body expression, found {len(body)}",
            body[1].span if body else form.span,
            hint="combine steps with (let [name expr ...] body) or (-> x f g)",
        )
    return name, tuple(args), body[0]


@special_form("defn", 1, "(defn NAME (args...) body)")
def _defn(form: ListNode, builder: Builder) -> None:
    name, args, body = _function_parts(form, "defn", "arguments")
    builder.functions[builder.claim(name, "function")] = FnDef(name.name, args, body, form.span)


@special_form("defmodel", 1, "(defmodel NAME (inputs...) body)")
def _defmodel(form: ListNode, builder: Builder) -> None:
    name, inputs, body = _function_parts(form, "defmodel", "inputs")
    builder.models[builder.claim(name, "model")] = ModelDef(name.name, inputs, body, form.span)
