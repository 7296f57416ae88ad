"""`check_op`: one harness checking an IR op against PyTorch and finite differences.

Forward: the interpreter's result against PyTorch on the CPU in f64, f32
and bf16. Backward (float operands): the IR gradient of ``sum(op(x) * w)``
for a random cotangent ``w`` against PyTorch autograd in f64 and f32, and
against central finite differences in f64. Tolerances come per dtype from
the tables below (looser for gradients).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from sexpgpu.devices.cpu import run
from sexpgpu.ir import builder as b
from sexpgpu.ir.autodiff import grad
from sexpgpu.ir.node import Graph, Node
from sexpgpu.ir.ops import Op

# (rtol, atol) per dtype.
FORWARD_TOL = {"f64": (1e-10, 1e-12), "f32": (2e-5, 2e-6), "bf16": (1e-2, 1e-2)}
GRAD_TOL = {"f64": (1e-8, 1e-10), "f32": (2e-4, 2e-5)}
FD_TOL = (1e-5, 1e-6)
FD_EPS = 1e-6
TORCH_DTYPE = {"f64": torch.float64, "f32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Arg:
    """An operand: its shape and kind ('float', 'positive', 'int<N>' ids below N, 'bool')."""

    shape: tuple[int, ...]
    kind: str = "float"

    @property
    def is_float(self) -> bool:
        return self.kind in ("float", "positive")

    def sample(self, rng: np.random.Generator) -> np.ndarray:
        if self.kind == "float":
            return rng.normal(size=self.shape)
        if self.kind == "positive":
            return rng.uniform(0.5, 2.0, size=self.shape)
        if self.kind == "bool":
            return rng.random(self.shape) < 0.5
        return rng.integers(0, int(self.kind[3:]), size=self.shape).astype(np.int32)


def _ir_dtype(arg: Arg, dtype: str) -> str:
    return dtype if arg.is_float else ("bool" if arg.kind == "bool" else "int32")


def _to_torch(value: np.ndarray, arg: Arg, dtype: str, requires_grad=False) -> torch.Tensor:
    if not arg.is_float:
        t = torch.from_numpy(np.asarray(value))
        return t.long() if arg.kind.startswith("int") else t
    t = torch.from_numpy(np.asarray(value, dtype=np.float64)).to(TORCH_DTYPE[dtype])
    return t.requires_grad_(requires_grad)


def _graph(build, args: Sequence[Arg], dtype: str, with_grad: bool):
    xs = [b.input(f"x{i}", a.shape, _ir_dtype(a, dtype)) for i, a in enumerate(args)]
    y = build(*xs)
    outputs = {"y": y}
    if with_grad:
        w = b.input("w", y.shape, y.dtype)
        loss = b.sum(b.mul(y, w))
        floats = [x for x, a in zip(xs, args, strict=True) if a.is_float]
        for i, g in enumerate(grad(loss, floats)):
            outputs[f"g{i}"] = g
        outputs["loss"] = loss
    return Graph.of(outputs, xs), y


def ops_built(build: Callable[..., Node], args: Sequence[Arg]) -> set[Op]:
    """The ops of the forward graph `build` makes from `args` (its inputs included)."""
    graph, _ = _graph(build, args, "f32", with_grad=False)
    return {node.op for node in graph.nodes()}


def check_op(
    build: Callable[..., Node],
    torch_fn: Callable[..., torch.Tensor],
    args: Sequence[Arg],
    *,
    seed: int = 0,
    dtypes: Sequence[str] = ("f64", "f32", "bf16"),
    differentiable: bool = True,
) -> None:
    """Check one op's forward (and backward) against PyTorch and finite differences.

    Parameters
    ----------
    build
        Builds the op from IR input nodes (one per `args` entry).
    torch_fn
        The same computation on torch tensors.
    args
        The operands' shapes and kinds.
    differentiable
        Whether to check gradients of the float operands.
    """
    rng = np.random.default_rng(seed)
    values = [a.sample(rng) for a in args]
    for dtype in dtypes:
        _check_forward(build, torch_fn, args, values, dtype)
    if differentiable and any(a.is_float for a in args):
        cot = None
        for dtype in ("f64", "f32"):
            graph, y = _graph(build, args, dtype, with_grad=True)
            if cot is None:
                cot = rng.normal(size=y.shape)
            feeds = {f"x{i}": v for i, v in enumerate(values)} | {"w": cot}
            out = run(graph, feeds)
            _check_against_autograd(torch_fn, args, values, cot, out, dtype)
            if dtype == "f64":
                _check_finite_differences(graph, args, values, cot, out)


def _check_forward(build, torch_fn, args, values, dtype) -> None:
    graph, _ = _graph(build, args, dtype, with_grad=False)
    got = run(graph, {f"x{i}": v for i, v in enumerate(values)})["y"]
    want = torch_fn(*(_to_torch(v, a, dtype) for v, a in zip(values, args, strict=True)))
    want = want.detach().to(torch.float64).numpy() if want.is_floating_point() else want.numpy()
    rtol, atol = FORWARD_TOL[dtype]
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"forward {dtype}")


def _check_against_autograd(torch_fn, args, values, cot, out, dtype) -> None:
    ts = [_to_torch(v, a, dtype, a.is_float) for v, a in zip(values, args, strict=True)]
    y = torch_fn(*ts)
    (y * torch.from_numpy(cot).to(y.dtype)).sum().backward()
    rtol, atol = GRAD_TOL[dtype]
    floats = [t for t, a in zip(ts, args, strict=True) if a.is_float]
    for i, t in enumerate(floats):
        want = t.grad.to(torch.float64).numpy() if t.grad is not None else np.zeros(t.shape)
        np.testing.assert_allclose(
            out[f"g{i}"], want, rtol=rtol, atol=atol, err_msg=f"gradient {i} vs autograd {dtype}"
        )


def _check_finite_differences(graph, args, values, cot, out) -> None:
    feeds = {f"x{i}": np.array(v) for i, v in enumerate(values)} | {"w": cot}
    graph = graph.with_outputs({"loss": graph.outputs["loss"]})
    float_names = [f"x{i}" for i, a in enumerate(args) if a.is_float]
    rtol, atol = FD_TOL
    for k, name in enumerate(float_names):
        x = feeds[name]
        numeric = np.zeros(x.shape)
        for index in np.ndindex(x.shape):
            keep = x[index]
            x[index] = keep + FD_EPS
            up = float(run(graph, feeds)["loss"])
            x[index] = keep - FD_EPS
            down = float(run(graph, feeds)["loss"])
            x[index] = keep
            numeric[index] = (up - down) / (2 * FD_EPS)
        np.testing.assert_allclose(
            out[f"g{k}"], numeric, rtol=rtol, atol=atol, err_msg=f"gradient {k} vs differences"
        )
