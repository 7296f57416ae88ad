"""The reader: experiment text to syntax nodes, each with its span.

One compiled regular expression splits the text into tokens (it also skips
whitespace, commas and ``;`` comments); a loop with an explicit stack of open
brackets builds the nodes, so deep nesting never recurses in Python. Offsets
move only in `_Reader.tokens`, and become line and column only in
`_Reader.span`, through a table of line starts and a binary search.

Choices where LANGUAGE.md is silent (see docs/language.md):

- commas are whitespace, as in Clojure;
- symbols are ASCII: letters, digits and ``+ - * / < > = ! ? _ . % & $ ^ ~``;
  strings and comments may hold any character;
- string escapes are ``\\"``, ``\\\\``, ``\\n`` and ``\\t``; a string may span lines;
- integers are decimal without leading zeros and fit in 64 bits; floats are
  finite; a token that starts like a number must be one;
- brackets nest at most `MAX_DEPTH` deep.
"""

from __future__ import annotations

import gc
import math
import re
from bisect import bisect_right
from collections.abc import Iterator
from itertools import accumulate
from os import PathLike
from pathlib import Path

from sexpgpu.errors import SexpgpuError, Source, Span
from sexpgpu.lang.syntax import Keyword, ListNode, Literal, Node, Symbol, Vector

__all__ = ["MAX_DEPTH", "load_text", "read", "read_file", "read_source"]

MAX_DEPTH = 200

_SYMBOL_CHARS = r"[A-Za-z0-9_+\-*/<>=!?.%&$^~]"
_TOKEN = re.compile(
    r"(?:[ \t\n\r\f\v,]+|;[^\n]*)*"  # skipped: whitespace, commas, comments
    r"(?:(?P<open>[(\[])"
    r"|(?P<close>[)\]])"
    r'|(?P<string>"[^"\\]*(?:\\.[^"\\]*)*")'
    r"|(?P<number>[+-]?\.?[0-9]" + _SYMBOL_CHARS + r"*)"
    r"|(?P<keyword>:" + _SYMBOL_CHARS + r"+)"
    r"|(?P<symbol>" + _SYMBOL_CHARS + r"+)"
    r"|(?P<end>\Z)"
    r"|(?P<bad>.))",
    re.DOTALL,
)
_INTEGER = re.compile(r"[+-]?(?:0|[1-9][0-9]*)")
_FLOAT = re.compile(
    r"[+-]?(?:(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[0-9]+[eE][+-]?[0-9]+)"
)
_ESCAPE = re.compile(r"\\(.)", re.DOTALL)
_ESCAPES = {'"': '"', "\\": "\\", "n": "\n", "t": "\t"}
_CLOSER = {"(": ")", "[": "]"}
_KIND = {"(": "list", "[": "vector", ")": "list", "]": "vector"}
_INT_LIMIT = 2**63
_NUMBER_HINT = "numbers look like 42, -3, 0.5 or 6e-4; a symbol cannot start with a digit"
_STRAY_HINTS = {
    "{": "maps are not part of the language; write keyword arguments `:key value`",
    "}": "maps are not part of the language; write keyword arguments `:key value`",
    "#": "comments start with `;`",
    "'": "there is no quoting: symbols are never evaluated by the reader",
    "`": "there is no quoting: symbols are never evaluated by the reader",
    ":": "a keyword needs a name right after the colon, as in `:steps`",
    '"': 'add `"` to end the string; write `\\"` for a quote inside it',
}
_STRAY_HINT = (
    "symbols use ASCII letters, digits and + - * / < > = ! ? _ . % & $ ^ ~; "
    "text goes in double quotes"
)


def read(text: str, name: str = "<string>") -> tuple[Node, ...]:
    """Read every top-level node of `text`.

    Parameters
    ----------
    text
        Experiment text.
    name
        The name spans and errors give the text (usually its path).

    Returns
    -------
    tuple of Node
        The top-level nodes in order.

    Raises
    ------
    SexpgpuError
        E-READ-001..006 and E-READ-008, at the offending character.
    """
    return read_source(Source(name, text))


def read_source(source: Source) -> tuple[Node, ...]:
    """Read every top-level node of `source` (see `read`)."""
    # The nodes of a read form no cycles; pausing the cycle collector while
    # millions of them are made saves it rescanning the growing tree.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _Reader(source).read_all()
    finally:
        if collecting:
            gc.enable()


def read_file(path: str | PathLike[str]) -> tuple[Node, ...]:
    """Read a UTF-8 experiment file (see `read`); E-READ-007 if it cannot be read."""
    return read(load_text(path), str(path))


def load_text(path: str | PathLike[str]) -> str:
    """The text of a UTF-8 file, or E-READ-007 naming why it cannot be read."""
    try:
        # utf-8-sig: a byte-order mark that some editors write first is not text.
        return Path(path).read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise SexpgpuError(
            "E-READ-007", f"no such file: {path}", str(path), hint="check the path"
        ) from None
    except IsADirectoryError:
        # A run folder where the experiment file goes (`sexpgpu sample runs/train ...`).
        run = (Path(path) / "run.json").is_file()
        hint = "give the experiment file (.lisp)"
        raise SexpgpuError(
            "E-READ-007",
            "a run folder, not an experiment file" if run else "a folder, not a file",
            str(path),
            hint=f"{hint} that trained it, with --resume latest --out {path}" if run else hint,
        ) from None
    except UnicodeDecodeError as err:
        raise SexpgpuError(
            "E-READ-007",
            f"not UTF-8 text: byte {err.start} cannot be decoded",
            str(path),
            hint="experiment files are UTF-8 text",
        ) from None
    except OSError as err:
        raise SexpgpuError(
            "E-READ-007",
            f"cannot read the file: {err.strerror}",
            str(path),
            hint="check the path and its permissions",
        ) from None


def _make_span_fast(source: Source, line: int, col: int, end_line: int, end_col: int) -> Span:
    # Span is a frozen dataclass: its __init__ sets each field through
    # object.__setattr__. Filling the instance dict at once halves the cost of a
    # span, the largest part of reading a token (benches/reader.py).
    span = object.__new__(Span)
    object.__setattr__(
        span,
        "__dict__",
        {"source": source, "line": line, "col": col, "end_line": end_line, "end_col": end_col},
    )
    return span


# the fast path needs a Span with an instance dict; otherwise build it plainly
_make_span = Span if hasattr(Span, "__slots__") else _make_span_fast


class _Reader:
    """One read of one source: the token loop and the offset-to-position table."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.text = source.text
        # starts[i] is the offset where line i + 1 begins
        self.starts = [0, *accumulate(len(line) + 1 for line in self.text.split("\n"))][:-1]

    def span(self, start: int, end: int) -> Span:
        """The span of text[start:end]; the only place offsets become positions."""
        starts = self.starts
        line = bisect_right(starts, start)
        # most tokens end on their own line: skip the second search
        end_line = line if line == len(starts) or end < starts[line] else bisect_right(starts, end)
        return _make_span(
            self.source,
            line,
            start - starts[line - 1] + 1,
            end_line,
            end - starts[end_line - 1] + 1,
        )

    def tokens(self) -> Iterator[tuple[str, int, int]]:
        """Yield (kind, start, end) for each token; the only place the offset advances."""
        for match in _TOKEN.finditer(self.text):
            kind = match.lastgroup
            if kind == "end":
                return
            yield kind, match.start(kind), match.end()

    def read_all(self) -> tuple[Node, ...]:
        text = self.text
        top: list[Node] = []
        items = top
        # each open bracket: (bracket, start offset, the items of the enclosing level)
        stack: list[tuple[str, int, list[Node]]] = []
        nested = None  # a bracket opened at column 1 inside the outermost open one
        for kind, start, end in self.tokens():
            if kind == "symbol":
                name = text[start:end]
                span = self.span(start, end)
                if name == "true" or name == "false":
                    items.append(Literal(name == "true", span))
                else:
                    items.append(Symbol(name, span))
            elif kind == "open":
                if len(stack) >= MAX_DEPTH:
                    raise self._too_deep(start)
                if stack and self._at_line_start(start) and self._outside(nested, stack):
                    nested = start
                stack.append((text[start], start, items))
                items = []
            elif kind == "close":
                if not stack:
                    raise self._unexpected_close(start)
                bracket, opened, outer = stack.pop()
                if _CLOSER[bracket] != text[start]:
                    raise self._mismatched(bracket, opened, start)
                node_type = ListNode if bracket == "(" else Vector
                outer.append(node_type(tuple(items), self.span(opened, end)))
                items = outer
            elif kind == "number":
                items.append(Literal(self._number(start, end), self.span(start, end)))
            elif kind == "keyword":
                items.append(Keyword(text[start + 1 : end], self.span(start, end)))
            elif kind == "string":
                items.append(Literal(self._string(start, end), self.span(start, end)))
            else:
                raise self._stray(start)
        if stack:
            raise self._unclosed(stack, nested)
        return tuple(top)

    def _at_line_start(self, offset: int) -> bool:
        return offset == 0 or self.text[offset - 1] == "\n"

    @staticmethod
    def _outside(nested: int | None, stack: list) -> bool:
        """Whether `nested` (an offset or None) lies before the outermost open bracket."""
        return nested is None or nested < stack[0][1]

    # -- atoms ------------------------------------------------------------------

    def _number(self, start: int, end: int) -> int | float:
        token = self.text[start:end]
        if _INTEGER.fullmatch(token):
            # checked before int() so that thousands of digits are never converted
            if len(token.lstrip("+-")) <= 19 and abs(value := int(token)) < _INT_LIMIT:
                return value
            raise self._error(
                "E-READ-005",
                f"integer `{_clip(token)}` is out of range",
                start,
                end,
                "integers must fit in 64 bits (|n| < 2^63); write a float such as 1e20",
            )
        if _FLOAT.fullmatch(token):
            value = float(token)
            if math.isfinite(value):
                return value
            raise self._error(
                "E-READ-005",
                f"float `{_clip(token)}` is out of range",
                start,
                end,
                "floats must be finite, at most about 1.8e308",
            )
        hint = _NUMBER_HINT
        if re.fullmatch(r"[+-]?0[0-9]+", token):
            hint = "integers are decimal and have no leading zeros"
        raise self._error("E-READ-005", f"malformed number `{_clip(token)}`", start, end, hint)

    def _string(self, start: int, end: int) -> str:
        body = self.text[start + 1 : end - 1]
        if "\\" not in body:
            return body
        for escape in _ESCAPE.finditer(body):
            if escape.group(1) not in _ESCAPES:
                at = start + 1 + escape.start()
                shown = escape.group(1) if escape.group(1).isprintable() else "?"
                raise self._error(
                    "E-READ-004",
                    f"unknown escape `\\{shown}` in a string",
                    at,
                    at + 2,
                    'the escapes are \\" \\\\ \\n and \\t; write \\\\ for a backslash',
                )
        return _ESCAPE.sub(lambda m: _ESCAPES[m.group(1)], body)

    # -- errors -----------------------------------------------------------------

    def _error(self, code: str, message: str, start: int, end: int, hint: str) -> SexpgpuError:
        return SexpgpuError(code, message, self.span(start, end), hint=hint)

    def _stray(self, start: int) -> SexpgpuError:
        char = self.text[start]
        if char == '"':
            return self._error(
                "E-READ-003",
                'unterminated string: the `"` here is never closed',
                start,
                start + 1,
                _STRAY_HINTS['"'],
            )
        shown = f"`{char}`" if char.isprintable() and not char.isspace() else f"U+{ord(char):04X}"
        hint = _STRAY_HINTS.get(char, _STRAY_HINT)
        return self._error("E-READ-006", f"unexpected character {shown}", start, start + 1, hint)

    def _unexpected_close(self, start: int) -> SexpgpuError:
        char = self.text[start]
        opener = "(" if char == ")" else "["
        return self._error(
            "E-READ-002",
            f"unexpected `{char}`: no {_KIND[char]} is open here",
            start,
            start + 1,
            f"remove it, or add the `{opener}` it should close",
        )

    def _mismatched(self, bracket: str, opened: int, start: int) -> SexpgpuError:
        char = self.text[start]
        where = self._position(opened)
        return self._error(
            "E-READ-002",
            f"`{char}` cannot close the `{bracket}` that opens at {where}",
            start,
            start + 1,
            f"close the {_KIND[bracket]} with `{_CLOSER[bracket]}`",
        )

    def _unclosed(
        self, stack: list[tuple[str, int, list[Node]]], nested_at_line_start: int | None
    ) -> SexpgpuError:
        bracket, opened, _ = stack[0]
        where = self._position(opened)
        hint = f"add `{_CLOSER[bracket]}` to close the {_KIND[bracket]} that opens at {where}"
        if nested_at_line_start is not None and nested_at_line_start > opened:
            line = self.span(nested_at_line_start, nested_at_line_start + 1).line
            hint += (
                f"; the form at {line}:1 starts inside it, so the `{_CLOSER[bracket]}` is"
                f" probably missing before line {line}"
            )
        elif len(stack) > 1:
            inner = self._position(stack[-1][1])
            hint += f" ({len(stack) - 1} more open inside it, the innermost at {inner})"
        return self._error(
            "E-READ-001",
            f"unclosed `{bracket}`: the {_KIND[bracket]} opened here is never closed",
            opened,
            opened + 1,
            hint,
        )

    def _too_deep(self, start: int) -> SexpgpuError:
        return self._error(
            "E-READ-008",
            f"brackets nested more than {MAX_DEPTH} deep",
            start,
            start + 1,
            "split the expression with `let` or a `defn`",
        )

    def _position(self, offset: int) -> str:
        span = self.span(offset, offset + 1)
        return f"{span.line}:{span.col}"


def _clip(token: str) -> str:
    return token if len(token) <= 30 else token[:27] + "..."
