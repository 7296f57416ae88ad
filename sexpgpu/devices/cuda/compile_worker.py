"""A worker process of `sexpgpu.devices.cuda.parallel_compile`: compiles graph parts on request.

It imports PyTorch and Inductor as soon as it starts (while the parent
traces), says it is ready, then compiles each part it is sent into the FX
graph cache it shares with the parent, and answers with the seconds it took
or the error. Messages are length-prefixed pickles on stdin and on the
process's original stdout; the libraries' own prints go to stderr.

    python -m sexpgpu.devices.cuda.compile_worker
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import time
from typing import Any, BinaryIO

__all__ = [
    "apply_settings",
    "compile_part",
    "input_metadata",
    "pack_graph",
    "receive",
    "send",
    "settings",
    "unpack_graph",
    "warm_up",
]


def send(stream: BinaryIO, message: Any) -> None:
    """Write one message: its pickle's length, then the pickle."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def receive(stream: BinaryIO) -> Any:
    """Read one message; None at the end of the stream."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    (size,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(size))


def input_metadata(gm: Any) -> list[tuple[tuple[int, ...], tuple[int, ...], Any]]:
    """(shape, strides, dtype) of each placeholder of a traced graph, from its fake values."""
    values = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    return [(tuple(v.shape), tuple(v.stride()), v.dtype) for v in values]


class _Ref:
    """A node among another node's operands, by name (`pack_graph`)."""

    def __init__(self, name: str) -> None:
        self.name = name


def pack_graph(gm: Any) -> bytes:
    """A graph of aten calls as bytes: its nodes one by one, and the tensors they read.

    Not a pickled ``GraphModule``: unpickling one traces its code again,
    which renames the calls after their targets (the kernel report reads the
    IR's names) and runs those with no operands (a ``zeros`` the graph adds
    into) once, into a constant that every call would then add into.
    """
    import torch

    def ref(value: Any) -> Any:
        return torch.fx.node.map_arg(value, lambda n: _Ref(n.name))

    nodes = []
    for node in gm.graph.nodes:
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            target = ("op", str(node.target))
        nodes.append((node.op, node.name, target, ref(node.args), ref(node.kwargs)))
    constants = {n.target: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    return pickle.dumps((nodes, constants), protocol=pickle.HIGHEST_PROTOCOL)


def unpack_graph(data: bytes) -> Any:
    """The ``GraphModule`` of `pack_graph`'s bytes, node for node.

    A module it calls (a split step's part) is an empty stand-in: whoever
    runs the graph holds the parts' compiled code. Its Python code is
    generated when first needed (a lazy module): where Inductor's cache
    serves the graph, only the cache key's hash reads it.
    """
    import torch
    from torch.fx._lazy_graph_module import _LazyGraphModule

    nodes, constants = pickle.loads(data)
    root = dict(constants)
    for op, _, target, _, _ in nodes:
        if op == "call_module":
            root[target] = torch.nn.Module()
    graph = torch.fx.Graph()
    made: dict[str, Any] = {}

    def resolve(value: Any) -> Any:
        if isinstance(value, _Ref):
            return made[value.name]
        if isinstance(value, (list, tuple)):
            return type(value)(resolve(v) for v in value)
        if isinstance(value, dict):
            return {k: resolve(v) for k, v in value.items()}
        return value

    for op, name, target, args, kwargs in nodes:
        if isinstance(target, tuple) and target[0] == "op":  # "aten.mm.default"
            namespace, packet, overload = target[1].split(".")
            target = getattr(getattr(getattr(torch.ops, namespace), packet), overload)
        if op == "output":
            graph.output(resolve(args[0]))
            continue
        made[name] = graph.create_node(op, target, resolve(args), resolve(kwargs), name=name)
    return _LazyGraphModule(root, graph)


def settings() -> dict[str, Any]:
    """This process's global settings that Inductor's code (and its cache key) depend on."""
    import torch

    matmul = torch.backends.cuda.matmul
    return {
        "fp32_precision": getattr(matmul, "fp32_precision", None),  # PyTorch 2.9 and later
        "fp16_reduced": matmul.allow_fp16_reduced_precision_reduction,
        "bf16_reduced": matmul.allow_bf16_reduced_precision_reduction,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        # In Inductor's cache key beside the mode: a worker without it compiles
        # parts the parent cannot load (measured: 0 of 5 parts on an H200).
        "fill_uninitialized": torch.utils.deterministic.fill_uninitialized_memory,
        "default_dtype": torch.get_default_dtype(),
    }


def apply_settings(values: dict[str, Any]) -> None:
    """Take the parent's `settings`, so that a part compiles here as it would there."""
    import torch

    matmul = torch.backends.cuda.matmul
    if values["fp32_precision"] is not None:
        matmul.fp32_precision = values["fp32_precision"]
    matmul.allow_fp16_reduced_precision_reduction = values["fp16_reduced"]
    matmul.allow_bf16_reduced_precision_reduction = values["bf16_reduced"]
    torch.backends.cudnn.allow_tf32 = values["cudnn_tf32"]
    torch.use_deterministic_algorithms(values["deterministic"])
    torch.utils.deterministic.fill_uninitialized_memory = values["fill_uninitialized"]
    torch.set_default_dtype(values["default_dtype"])


def compile_part(graph: Any, inputs: list, device: str, options: dict[str, Any]) -> Any:
    """``torch._inductor.compile`` of `graph` on fake inputs of these shapes, strides and dtypes.

    The FX graph cache's key depends on the graph and its inputs' metadata
    only, so the parent and a worker compiling one part meet in one entry.
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # The cache keys graphs whose inputs come with a shape environment (static here).
    mode = FakeTensorMode(allow_fallback_kernels=True, shape_env=ShapeEnv())
    with mode:
        examples = [torch.empty_strided(s, st, dtype=d, device=device) for s, st, d in inputs]
    # AOTAutograd's key renames the inputs before hashing the graph's code, which costs
    # two more generations of that code (seconds for a large step): the names here
    # are the same in every run already (`pack_graph` keeps them).
    functorch = torch._functorch.config
    same_names = {"autograd_cache_normalize_inputs": False}
    if not hasattr(functorch, "autograd_cache_normalize_inputs"):
        same_names = {}
    from sexpgpu.devices.cuda import readback_barrier

    readback_barrier.install()
    barrier = readback_barrier.options()
    with torch._inductor.config.patch({**options, **barrier}), functorch.patch(same_names):
        return torch._inductor.compile(graph, examples)


def warm_up(device: str, options: dict[str, Any]) -> None:
    """Compile a graph of one kernel, for the imports and set-up of a process's first compile.

    The parent runs it while the workers compile its parts: on an H200 the
    first part it loaded took 6 s, the others 0.4 s each.
    """
    import torch

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output((graph.call_function(torch.ops.aten.mul.Tensor, (x, x)),))
    compile_part(torch.fx.GraphModule({}, graph), [((64,), (1,), torch.float32)], device, options)


def main() -> None:
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the libraries' prints must not land among the replies
    import torch
    import torch._inductor.compile_fx  # the imports are most of a start

    # The custom ops a graph may call.
    import sexpgpu.devices.cuda.gelu_products
    import sexpgpu.devices.cuda.scatter_rows
    import sexpgpu.devices.cuda.sum_products
    import sexpgpu.devices.cuda.xent  # noqa: F401

    send(replies, ("ready", torch.__version__))
    while (job := receive(sys.stdin.buffer)) is not None:
        try:
            began = time.perf_counter()
            apply_settings(job["settings"])
            graph = unpack_graph(job["graph"])
            compile_part(graph, job["inputs"], job["device"], job["options"])
            send(replies, ("done", time.perf_counter() - began))
        except Exception as error:  # the parent compiles the part itself
            send(replies, ("failed", f"{type(error).__name__}: {error}"))


if __name__ == "__main__":
    # The package's copy of this module, not __main__: the jobs' pickles name its classes.
    from sexpgpu.devices.cuda.compile_worker import main as package_main

    package_main()
