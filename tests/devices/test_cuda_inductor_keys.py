"""`sexpgpu.devices.cuda.inductor_keys`: a graph's code noted by its AOTAutograd key, loaded by it.

On PyTorch's CPU device, where Inductor compiles C++.
"""

from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")

from sexpgpu.devices.cuda.compile_worker import compile_part  # noqa: E402
from sexpgpu.devices.cuda.inductor_keys import load_by_key, noting_key  # noqa: E402

NEEDS_CXX = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler for Inductor")


def _graph(one_result: bool) -> torch.fx.GraphModule:
    """``x * 2 + c`` with ``c`` a constant of the graph (a buffer, the code's first operand)."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    c = graph.get_attr("c")
    y = graph.call_function(
        torch.ops.aten.add.Tensor, (graph.call_function(torch.ops.aten.mul.Tensor, (x, 2.0)), c)
    )
    graph.output(y if one_result else (y, x))
    return torch.fx.GraphModule({"c": torch.arange(8.0)}, graph)


@NEEDS_CXX
@pytest.mark.parametrize("one_result", [True, False])
def test_a_graph_loads_by_the_key_noted_when_it_compiled(tmp_path, monkeypatch, one_result):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    with noting_key() as noted:
        compiled = compile_part(_graph(one_result), [((8,), (1,), torch.float32)], "cpu", {})
    assert noted.key is not None
    loaded = load_by_key(noted.key, _graph(one_result), {})
    x = torch.randn(8)
    want, got = compiled(x), loaded(x)
    assert type(got) is type(want)  # one result unwrapped, as Inductor's own call does
    got, want = ([got], [want]) if one_result else (got, want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    inputs = [x]
    assert loaded.call_boxed(inputs) is not None and inputs == []  # the boxed call empties


@NEEDS_CXX
def test_a_key_of_nothing_loads_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    assert load_by_key("0" * 52, _graph(True), {}) is None
