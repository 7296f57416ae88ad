"""Text from a trained token or byte model: prompts in, seeded samples out.

A model samples when its output graph (`sexpgpu.ir.compile.output_graph`)
reads one row of ``seq`` int32 ids and gives ``[1 seq vocab]`` logits, and
position t of the output depends only on ids up to t (its attention is
causal): a window shorter than ``seq`` is then padded on the right and read
at its last id. Each new token runs the step on the last ``seq`` ids; on the
cuda device the step is captured once and replayed
(`sexpgpu.devices.cuda.decode`). Draws come from one NumPy generator seeded by
``--seed``, so one seed gives one text on one device.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from sexpgpu.errors import SexpgpuError
from sexpgpu.ir.dtypes import FLOATS, DType
from sexpgpu.ir.node import Graph
from sexpgpu.ir.ops import Op

__all__ = ["BYTE_SOURCES", "Sampler", "Vocabulary", "check_samplable", "cpu_step", "pick"]

# Data sources whose ids are bytes (decoded as UTF-8); `tokens` ids are printed as numbers.
BYTE_SOURCES = frozenset({"bytes", "python-stdlib"})

Step = Callable[[np.ndarray, int], np.ndarray]  # (ids [1 seq], position) -> logits


@dataclass(frozen=True)
class Vocabulary:
    """How prompts become ids and ids text: bytes as UTF-8, or token ids as numbers."""

    size: int
    byte_level: bool

    def encode(self, prompt: str) -> list[int]:
        """The prompt's ids (E-SAMPLE-002 when it has none or one past the vocabulary)."""
        if self.byte_level:
            ids = list(prompt.encode("utf-8"))
        else:
            try:
                ids = [int(word) for word in prompt.replace(",", " ").split()]
            except ValueError:
                raise SexpgpuError(
                    "E-SAMPLE-002",
                    f"--prompt {prompt!r}: a token model's prompt is token ids",
                    "--prompt",
                    hint="give ids separated by spaces, e.g. --prompt '464 2068 7586'",
                ) from None
        if not ids:
            raise SexpgpuError(
                "E-SAMPLE-002",
                "--prompt is empty: there is nothing to continue",
                "--prompt",
                hint="give some text (or token ids) to continue",
            )
        bad = [i for i in ids if not 0 <= i < self.size]
        if bad:
            raise SexpgpuError(
                "E-SAMPLE-002",
                f"--prompt holds id {bad[0]}, outside the model's vocabulary of {self.size}",
                "--prompt",
                hint=f"use ids 0 to {self.size - 1}",
            )
        return ids

    def decoder(self) -> Callable[[list[int]], str]:
        """A function from each next run of ids to its text (UTF-8 kept whole across calls)."""
        if not self.byte_level:
            return lambda ids: "".join(f" {i}" for i in ids)
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return lambda ids: utf8.decode(bytes(ids))


def pick(
    logits: np.ndarray, temperature: float, top_k: int | None, rng: np.random.Generator
) -> int:
    """One id from `logits`: the argmax at temperature 0, else a draw from the softmax."""
    if temperature == 0:
        return int(np.argmax(logits))
    scaled = logits / temperature
    if top_k is not None and top_k < len(scaled):
        cut = np.partition(scaled, -top_k)[-top_k]
        scaled = np.where(scaled >= cut, scaled, -np.inf)
    p = np.exp(scaled - scaled.max())
    cdf = np.cumsum(p)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(p) - 1))


def check_samplable(graph: Graph | None, where: str) -> tuple[int, int]:
    """``(seq, vocab)`` of an output graph that samples, else E-SAMPLE-001 saying why not."""

    def refuse(why: str) -> SexpgpuError:
        return SexpgpuError(
            "E-SAMPLE-001",
            f"the model of this run does not sample: {why}",
            where,
            hint="sample needs a language model: (model ids) -> [.. seq vocab] logits, "
            "attention causal, trained on (tokens ...), (bytes ...) or (python-stdlib)",
        )

    if graph is None:
        raise refuse("its loss calls no model")
    inputs = list(graph.inputs.values())
    if len(inputs) != 1 or inputs[0].dtype is not DType.INT32 or len(inputs[0].shape) != 2:
        found = ", ".join(f"{n.name} {n.dtype} {list(n.shape)}" for n in inputs)
        raise refuse(f"it reads {found or 'no data'}, not one [batch seq] field of int32 ids")
    out = graph.outputs["output"]
    seq = inputs[0].shape[1]
    if out.dtype not in FLOATS or out.shape[:-1] != inputs[0].shape:
        raise refuse(f"its output is {out.dtype} {list(out.shape)}, not [1 {seq} vocab] logits")
    for node in graph.nodes():
        if node.op is Op.ATTENTION and not node.attrs.get("causal"):
            raise refuse(f"its attention at {node.span} is not causal")
    return seq, out.shape[-1]


def cpu_step(graph: Graph, params: Mapping[str, np.ndarray]) -> Step:
    """The output graph on the IR interpreter, as a `Step`."""
    from sexpgpu.devices.cpu import CpuProgram

    program = CpuProgram(graph)
    (name,) = graph.inputs
    feeds = {k: np.asarray(params[k], np.float32) for k in graph.params}

    def step(ids: np.ndarray, position: int) -> np.ndarray:
        out = program({**feeds, name: ids})["output"]
        return np.asarray(out[0, position], np.float64)

    return step


@dataclass
class Sampler:
    """Continues prompts with a model's `step`.

    Attributes
    ----------
    step
        ``(ids [1 seq], position) -> logits`` of the model.
    seq
        The model's window.
    vocab
        How prompts and ids map to text.
    """

    step: Step
    seq: int
    vocab: Vocabulary

    def generate(
        self,
        prompt: list[int],
        tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int = 0,
    ) -> Iterator[int]:
        """Yield `tokens` new ids after `prompt` (of which the last `seq` are read)."""
        rng = np.random.default_rng(seed)
        context = list(prompt[-self.seq :])
        window = np.zeros((1, self.seq), np.int32)
        for _ in range(tokens):
            context = context[-self.seq :]
            window[0, : len(context)] = context
            window[0, len(context) :] = 0  # right padding: a causal model never reads it
            chosen = pick(self.step(window, len(context) - 1), temperature, top_k, rng)
            context.append(chosen)
            yield chosen
