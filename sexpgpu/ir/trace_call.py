"""What a vocabulary function sees when the tracer calls it: `Call`.

A vocabulary entry (`sexpgpu.ir.vocabulary`) receives one `Call` holding its
evaluated arguments with their spans, the run's float dtype and a way to make
parameters under the call's own path. The helpers read an argument as the
kind the entry needs (a tensor, an integer, a vector of axes...) and raise
`SexpgpuError` E-TRACE-004 at that argument's span otherwise.

A traced value is a `Node` (a tensor), a Python int, float, bool or str (a
number folded at trace time, such as ``(* 4 width)``), or a tuple of values
(a vector such as ``[vocab width]``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sexpgpu.errors import SexpgpuError, Span
from sexpgpu.ir import builder as b
from sexpgpu.ir.dtypes import DType
from sexpgpu.ir.node import Node
from sexpgpu.ir.shape_rules import format_shape
from sexpgpu.ir.trace_init import Init

__all__ = ["Call", "Value", "describe_value", "is_number"]

Value = Node | int | float | bool | str | tuple
ArgKey = int | str  # a position or a keyword name


def is_number(value: object) -> bool:
    """True for a Python int or float (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def describe_value(value: Value) -> str:
    """A short phrase for messages: ``a f32 tensor [3 16]``, ``the integer 4``."""
    if isinstance(value, Node):
        return f"a {value.dtype} tensor {format_shape(value.shape)}"
    if isinstance(value, bool):
        return f"the boolean {'true' if value else 'false'}"
    if isinstance(value, int):
        return f"the integer {value}"
    if isinstance(value, float):
        return f"the number {value:g}"
    if isinstance(value, str):
        return f"the string {value!r}"
    return f"a vector of {len(value)}"


@dataclass
class Call:
    """One call of a vocabulary entry, with its arguments evaluated.

    Attributes
    ----------
    name
        The name called (``linear``).
    span
        The call form's span: where nodes and errors point.
    args, arg_spans
        Positional arguments and their spans.
    kwargs, kw_spans
        Keyword arguments (without the colon) and their spans.
    dtype
        The run's float dtype (f32 or bf16): the dtype of new constants.
    make_param
        ``make_param(name, shape, init, span) -> Node``: a parameter named
        ``<this call's path>/<name>`` (layers only).
    arg_texts
        Position -> the argument's source text, for hints (threaded values
        have none).
    random_key
        ``random_key() -> (key, salt)``: the microbatch's int32 random key
        (a fed input) and a salt of this call's path (layers only).
    train_only
        ``train_only(result, identity) -> result``: marks `result` as a value
        of the training graph that evaluation replaces by `identity`
        (dropout; layers only).
    """

    name: str
    span: Span
    args: list[Value]
    arg_spans: list[Span]
    kwargs: dict[str, Value] = field(default_factory=dict)
    kw_spans: dict[str, Span] = field(default_factory=dict)
    dtype: DType = DType.F32
    make_param: Callable[[str, tuple[int, ...], Init, Span], Node] | None = None
    arg_texts: dict[int, str] = field(default_factory=dict)
    random_key: Callable[[], tuple[Node, int]] | None = None
    train_only: Callable[[Node, Node], Node] | None = None

    # ------------------------------------------------------------ access

    def get(self, key: ArgKey) -> Value:
        """The raw argument (a keyword's default is filled in by the tracer)."""
        return self.kwargs[key] if isinstance(key, str) else self.args[key]

    def where(self, key: ArgKey) -> Span:
        """The argument's span (the call's when it was not written)."""
        if isinstance(key, str):
            return self.kw_spans.get(key, self.span)
        return self.arg_spans[key] if key < len(self.arg_spans) else self.span

    def label(self, key: ArgKey) -> str:
        """How messages name the argument: ``:axis of softmax``, ``argument 2 of linear``."""
        if isinstance(key, str):
            return f"`:{key}` of {self.name}"
        return f"argument {key + 1} of {self.name}"

    def text(self, i: int) -> str:
        """How a hint writes positional argument `i`: its source text, else a phrase."""
        return self.arg_texts.get(i, f"argument {i + 1}")

    def fail(self, message: str, hint: str, key: ArgKey | None = None) -> SexpgpuError:
        """An E-TRACE-004 error at the argument `key` (or at the call)."""
        at = self.span if key is None else self.where(key)
        return SexpgpuError("E-TRACE-004", message, at, hint)

    # ------------------------------------------------------------ typed readers

    def tensor(self, key: ArgKey) -> Node:
        """The argument as a tensor; a number becomes a scalar constant of the run's dtype."""
        value = self.get(key)
        if isinstance(value, Node):
            return value
        if is_number(value):
            return b.constant(value, self.dtype, span=self.where(key))
        raise self.fail(
            f"{self.label(key)} must be a tensor, found {describe_value(value)}",
            "pass a tensor: a model input, a parameter or the result of a call",
            key,
        )

    def integer(self, key: ArgKey, minimum: int | None = None) -> int:
        """The argument as an integer (at least `minimum` when given)."""
        value = self.get(key)
        # 4.0 is refused where it is written, not taken for 4: a float here is most
        # often a size computed with `/`, which the next shape would blame.
        if not is_number(value) or not isinstance(value, int):
            hint, found = "write a whole number or a parameter holding one", describe_value(value)
            if isinstance(value, float):
                hint = "write it without a decimal point; divide sizes with (// a b), not (/ a b)"
                found = f"the float {value!r}"
            raise self.fail(
                f"{self.label(key)} must be an integer, found {found}",
                hint,
                key,
            )
        if minimum is not None and value < minimum:
            raise self.fail(
                f"{self.label(key)} must be at least {minimum}, found {value}",
                f"use a value of {minimum} or more",
                key,
            )
        return value

    def number(self, key: ArgKey, positive: bool = False) -> float:
        """The argument as a number (above 0 when `positive`)."""
        value = self.get(key)
        if not is_number(value):
            raise self.fail(
                f"{self.label(key)} must be a number, found {describe_value(value)}",
                "write a number or a parameter holding one",
                key,
            )
        if positive and not 0 < value < math.inf:
            raise self.fail(
                f"{self.label(key)} must be positive, found {describe_value(value)}",
                "use a small positive number, e.g. 1e-5",
                key,
            )
        return float(value)

    def boolean(self, key: ArgKey) -> bool:
        """The argument as true or false."""
        value = self.get(key)
        if not isinstance(value, bool):
            raise self.fail(
                f"{self.label(key)} must be true or false, found {describe_value(value)}",
                "write true or false",
                key,
            )
        return value

    def ints(self, key: ArgKey, minimum: int | None = None) -> tuple[int, ...]:
        """The argument as a vector of integers (``[2 0 1]``); an integer is a vector of one."""
        value = self.get(key)
        items = value if isinstance(value, tuple) else (value,)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in items) or (
            minimum is not None and any(v < minimum for v in items)
        ):
            least = "" if minimum is None else f" of at least {minimum}"
            raise self.fail(
                f"{self.label(key)} must be a vector of integers{least}, "
                f"found {describe_value(value)}",
                "write a vector such as [2 16]",
                key,
            )
        return tuple(items)

    def axes(self, key: str) -> tuple[int, ...] | None:
        """``:axis`` as a tuple of axes (None when absent: every axis)."""
        value = self.get(key)
        return None if value is None else self.ints(key)

    def tensors(self, keys: Sequence[ArgKey]) -> list[Node]:
        """Several arguments as tensors of one dtype: numbers become constants of the
        tensors' dtype (the run's dtype when none is a tensor)."""
        nodes = [self.get(k) for k in keys]
        dtype = next((n.dtype for n in nodes if isinstance(n, Node)), self.dtype)
        out = []
        for key, value in zip(keys, nodes, strict=True):
            if is_number(value) and not isinstance(value, Node):
                if dtype == DType.INT32 and not float(value).is_integer():
                    raise self.fail(
                        f"{self.name}: the number {value:g} cannot join an int32 tensor",
                        "cast the tensor first: (cast x :dtype f32)",
                        key,
                    )
                out.append(b.constant(value, dtype, span=self.where(key)))
            else:
                out.append(self.tensor(key))
        return out

    def param(self, name: str, shape: Sequence[int], init: Init) -> Node:
        """A parameter of this layer, named ``<the layer's path>/<name>``."""
        assert self.make_param is not None, f"{self.name} is not a layer"
        return self.make_param(name, tuple(int(d) for d in shape), init, self.span)
