"""User-facing errors: `SexpgpuError` with a code, a location and a hint.

Every error a user can cause is a `SexpgpuError` whose code is listed in
`CODES` (and in docs/errors.md, checked by a test). Internal invariants use
`assert`; the CLI hides their traceback unless ``SEXPGPU_DEBUG=1``.

This module imports nothing of sexpgpu: every layer may raise these errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CODES", "SexpgpuError", "Source", "Span"]


@dataclass(frozen=True, eq=False)
class Source:
    """A named text that spans point into (a file, or a string given in code).

    Compared by identity: two reads of one file are two sources.
    """

    name: str
    text: str = field(repr=False)

    def line(self, number: int) -> str:
        """The 1-based line `number` without its newline ('' past the end)."""
        lines = self.text.split("\n")
        return lines[number - 1].rstrip("\r") if 0 < number <= len(lines) else ""


@dataclass(frozen=True)
class Span:
    """Where a node sits in its source: 1-based line and column, end exclusive."""

    source: Source
    line: int
    col: int
    end_line: int
    end_col: int

    def __str__(self) -> str:
        return f"{self.source.name}:{self.line}:{self.col}"

    def to(self, other: Span) -> Span:
        """The span from the start of `self` to the end of `other`."""
        return Span(self.source, self.line, self.col, other.end_line, other.end_col)


# The code table. Each area owns a prefix; docs/errors.md explains each code.
CODES: dict[str, str] = {
    # reader
    "E-READ-001": "unbalanced bracket: a list or vector is not closed",
    "E-READ-002": "unexpected closing bracket, or a bracket of the wrong kind",
    "E-READ-003": "unterminated string",
    "E-READ-004": "unknown escape in a string",
    "E-READ-005": "malformed number, or one out of range",
    "E-READ-006": "stray character",
    "E-READ-007": "file cannot be read (missing, a folder, unreadable or not UTF-8)",
    "E-READ-008": "brackets nested too deeply",
    # forms
    "E-FORM-001": "unknown top-level form",
    "E-FORM-002": "wrong number of arguments or items in a form",
    "E-FORM-003": "unknown, missing or misplaced key in a form",
    "E-FORM-004": "duplicate definition, key or name",
    "E-FORM-005": "value of the wrong type or out of range",
    "E-FORM-006": "unknown name (parameter, data set, model, run, variant, ...) or no run chosen",
    "E-FORM-007": "parameter expression has no result (division by zero, overflow)",
    # devices and data parallelism (DESIGN.md)
    "E-DP-001": "SEXPGPU_DEVICES does not parse, repeats or names an invisible ordinal, "
    "or no GPU is visible",
    "E-DP-002": "resume with another rank count, node count or loader rank than the checkpoint's",
    "E-DP-003": "global microbatches do not divide over the GPUs",
    "E-DP-004": "ranks' or nodes' parameters/optimizer states disagree at a checkpoint",
    "E-DP-005": "node variables malformed",
    "E-DP-006": "a node differs from node 0 at the rendezvous",
    "E-DP-007": "a node did not arrive within SEXPGPU_NODE_TIMEOUT (300 s), or left the run",
    "E-MEM-001": "no memory plan fits the card, even recomputing forward values in the backward",
    "E-MEM-002": "an allocation failed after release, retry and split",
    "E-DEV-001": "the cuda device refuses a GPU below compute capability 8.0",
    "E-DEV-002": "the cuda device needs PyTorch, which is not installed",
    # IR shapes and dtypes
    "E-SHAPE-001": "shapes do not broadcast",
    "E-SHAPE-002": "dtype not accepted by an operation, or operand dtypes differ",
    "E-SHAPE-003": "matmul: inner dimensions differ",
    "E-SHAPE-004": "axis out of range, repeated, or not a permutation",
    "E-SHAPE-005": "reshape: element counts differ",
    "E-SHAPE-006": "matmul: an operand has fewer than 2 axes",
    "E-SHAPE-007": "slice or pad bounds out of range",
    "E-SHAPE-008": "concat: shapes differ off the concatenation axis",
    "E-SHAPE-009": "take or scatter: indices not int32, or shapes disagree",
    "E-SHAPE-010": "cross-entropy: logits and targets disagree",
    "E-SHAPE-011": "attention: queries, keys and values differ in shape",
    "E-SHAPE-012": "a value too large: more than 2^48 elements or 64 axes, or a size not whole",
    "E-SHAPE-013": "a loss's prediction and target differ in shape",
    # tracing model bodies
    "E-TRACE-001": "unknown function in a model or loss",
    "E-TRACE-002": "unknown name in a model or loss, or a function used as a value",
    "E-TRACE-003": "wrong number of arguments, or an unknown, repeated or valueless keyword",
    "E-TRACE-004": "argument of the wrong kind (a number, tensor, vector or boolean expected)",
    "E-TRACE-005": "malformed let, ->, repeat or param form",
    "E-TRACE-006": "the loss is not a float scalar, or (to train) depends on no parameter",
    "E-TRACE-007": "calls nest without end (a defn calls itself)",
    "E-TRACE-008": "the model expands to too many calls (a huge repeat, layers or fan-out)",
    # command line
    "E-CLI-001": "bad command-line argument or environment variable",
    # training data
    "E-DATA-001": "data file missing or unreadable",
    "E-DATA-002": "data set empty, or too short for the sequence length, batch or split",
    "E-DATA-003": "data file of the wrong dtype or size",
    "E-DATA-004": "data field missing, or fields of different lengths",
    "E-DATA-006": "an id in the data is out of range for the model (vocabulary or classes)",
    "E-DATA-007": "float data holds NaN or infinite values",
    "E-DATA-008": "a data set's fields do not fit the model it is evaluated with",
    # training runs
    "E-TRAIN-002": "the loss became NaN or infinite",
    # checkpoints
    "E-CKPT-001": "no complete checkpoint to resume from",
    "E-CKPT-002": "checkpoint damaged: a file is missing or its checksum differs",
    "E-CKPT-003": "resume of a checkpoint written by another experiment (a setting differs)",
    "E-CKPT-004": "checkpoint location cannot be used (unsupported scheme, unreachable, "
    "missing s3fs)",
    "E-CKPT-005": "run folder holds another experiment's or run's records",
    "E-CKPT-006": "a resume would rewrite history: the target is below the checkpoint, "
    "or the run folder holds a newer one",
    # using a trained model
    "E-SAMPLE-001": "the run's model is not a language model sample can continue",
    "E-SAMPLE-002": "the prompt does not encode into the model's vocabulary",
    "E-HF-001": "the model maps to no architecture transformers knows (the first mismatch named)",
    "E-HF-002": "a transformers folder does not match the experiment's model, or cannot be read",
    # plotting
    "E-PLOT-001": "plot needs matplotlib (the `plot` extra)",
    "E-PLOT-002": "run directory has no metrics to plot",
    "E-PLOT-003": "a run's metrics.jsonl is not a readable file",
}


class SexpgpuError(Exception):
    """An error the user can fix: what is wrong, where, and how to fix it.

    Parameters
    ----------
    code
        A key of `CODES`, such as ``"E-READ-001"``.
    message
        What is wrong, naming the offending values.
    location
        A `Span` into a source text, a plain string (a path, a variable
        name), or None.
    hint
        How to fix it: the valid options, the nearest name, the command.
    """

    def __init__(
        self,
        code: str,
        message: str,
        location: Span | str | None = None,
        hint: str | None = None,
    ) -> None:
        assert code in CODES, f"unregistered error code {code}"
        super().__init__(message)
        self.code = code
        self.message = message
        self.location = location
        self.hint = hint

    def __str__(self) -> str:
        return self.render()

    def render(self) -> str:
        """The error as the CLI prints it: header, location, source line, caret, hint."""
        out = [f"error[{self.code}]: {self.message}"]
        if isinstance(self.location, Span):
            out += _source_excerpt(self.location)
            gutter = " " * len(str(self.location.line))
        else:
            gutter = " "
            if self.location:
                out.append(f"{gutter}--> {self.location}")
        if self.hint:
            out.append(f"{gutter} = hint: {self.hint}")
        return "\n".join(out)


def _source_excerpt(span: Span) -> list[str]:
    number = str(span.line)
    gutter = " " * len(number)
    text = span.source.line(span.line).expandtabs(1)
    caret = " " * (span.col - 1) + "^"
    return [
        f"{gutter}--> {span}",
        f"{gutter} |",
        f"{number} | {text}".rstrip(),
        f"{gutter} | {caret}",
    ]
