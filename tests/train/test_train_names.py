"""The language and the trainer keep separate tables of the names users type: they must agree."""

from sexpgpu.devices import optim
from sexpgpu.lang import runs
from sexpgpu.train import metrics, rank, schedules


def test_the_language_reads_what_the_trainer_runs():
    assert set(runs.OPTIMIZERS) == set(optim.OPTIMIZERS)
    assert set(runs.SCHEDULES) == set(schedules.SCHEDULES)
    assert {name: tuple(options) for name, options in runs.SCHEDULES.items()} == dict(
        schedules._OPTIONS
    )
    assert set(runs.DIAGNOSTICS) == set(rank.DIAGNOSTICS)
    assert set(runs.REDUCERS) == set(metrics.REDUCERS)
