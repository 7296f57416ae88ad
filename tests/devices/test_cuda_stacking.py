"""The stacking choice (`sexpgpu.devices.cuda.stacking`): its order of reasons and its memory."""

from __future__ import annotations

import json
from pathlib import Path

from sexpgpu.devices.cuda.stacking import CostModel, choices_path, choose, degrees, graph_key


def test_degrees_divide_the_microbatches() -> None:
    assert degrees(6) == [6, 3, 2, 1]
    assert degrees(1) == [1]


def test_the_cache_honours_xdg() -> None:
    assert choices_path({"XDG_CACHE_HOME": "/x"}) == Path("/x/sexpgpu/choices.json")
    assert choices_path({}).parts[-3:] == (".cache", "sexpgpu", "choices.json")


def test_the_only_degree_that_fits(tmp_path: Path) -> None:
    choice = choose([1], {1: 5.0}, key="k", path=tmp_path / "c.json", measure=None)
    assert (choice.degree, choice.reason) == (1, "the only degree that fits the plan")


def test_the_model_picks_when_it_sees_a_clear_difference(tmp_path: Path) -> None:
    def never(d: int) -> float:
        raise AssertionError("no measurement when the model is sure")

    choice = choose(
        [4, 2, 1], {4: 50.0, 2: 80.0, 1: 130.0}, key="k", path=tmp_path / "c.json", measure=never
    )
    assert choice.degree == 4 and choice.reason.startswith("the cost model's pick (50.0 ms")


def test_close_predictions_are_measured_once_then_remembered(tmp_path: Path) -> None:
    path = tmp_path / "sexpgpu" / "choices.json"
    model = {4: 130.5, 2: 131.5, 1: 200.0}
    calls = []

    def measure(d: int) -> float:
        calls.append(d)
        return {4: 130.2, 2: 128.9}[d]

    first = choose([4, 2, 1], model, key="k", path=path, measure=measure)
    assert first.degree == 2 and calls == [4, 2]
    assert first.line() == (
        "stacking 2: measured at the first step, the model within 5% could not separate them "
        "(4 130.2 ms, model 130.5 ms; 2 128.9 ms, model 131.5 ms)"
    )
    assert json.loads(path.read_text())["k"]["degree"] == 2
    again = choose([4, 2, 1], model, key="k", path=path, measure=measure)
    assert again.degree == 2 and calls == [4, 2]
    assert again.reason.startswith("measured earlier on this device")
    path.unlink()  # deleting the file measures again
    choose([4, 2, 1], model, key="k", path=path, measure=measure)
    assert calls == [4, 2, 4, 2]


def test_a_damaged_cache_is_measured_over(tmp_path: Path) -> None:
    path = tmp_path / "choices.json"
    path.write_text("{not json")
    choice = choose([2, 1], {2: 10.0, 1: 10.1}, key="k", path=path, measure=lambda d: float(d))
    assert choice.degree == 1 and json.loads(path.read_text())["k"]["degree"] == 1


def test_without_a_gpu_the_choice_waits_for_one(tmp_path: Path) -> None:
    choice = choose([2, 1], {2: 10.0, 1: 10.1}, key="k", path=tmp_path / "c.json", measure=None)
    assert choice.degree == 2 and "until measured on the GPU" in choice.reason


def test_the_key_names_graph_device_and_microbatches() -> None:
    a = graph_key("graph", "H200", 4)
    assert a != graph_key("graph2", "H200", 4) != graph_key("graph", "A100", 4)
    assert a != graph_key("graph", "H200", 8)


def test_the_model_prefers_fewer_launches_for_small_graphs() -> None:
    model = CostModel.for_dtype("f32")
    one = model.step_ms(calls=4, flops=10**6, moved_bytes=10**5, nodes=200)
    four = model.step_ms(calls=1, flops=4 * 10**6, moved_bytes=4 * 10**5, nodes=210)
    assert four < 0.5 * one


def test_a_deterministic_run_takes_the_models_pick_and_measures_nothing() -> None:
    def never(d: int) -> float:
        raise AssertionError("a measurement may differ between runs")

    choice = choose([2, 1], {2: 130.5, 1: 131.0}, key="k", path=None, measure=never)
    assert choice.degree == 2
    assert choice.reason == (
        "the cost model's pick (130.5 ms; 1 131.0 ms), deterministic: nothing measured"
    )
