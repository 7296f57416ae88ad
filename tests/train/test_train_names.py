"""The language holds the names users type; execution keys its implementations by the same names.

Devices and the trainer may not import the language's tables, so this test
is the link between the two sides.
"""

import inspect

from sexpgpu.devices import optim
from sexpgpu.lang import data as lang_data
from sexpgpu.lang import runs
from sexpgpu.train import data, metrics, rank, schedules


def _keywords(rule) -> set[str]:
    params = inspect.signature(rule).parameters.values()
    return {p.name for p in params if p.kind is p.KEYWORD_ONLY}


def test_every_optimizer_the_language_reads_is_implemented():
    assert set(runs.OPTIMIZERS) == set(optim.OPTIMIZERS)


def test_every_schedule_the_language_reads_is_a_rule_of_its_options():
    assert set(runs.SCHEDULES) == set(schedules.SCHEDULES)
    for name, rule in schedules.SCHEDULES.items():
        assert _keywords(rule) == {k.replace("-", "_") for k in runs.SCHEDULES[name]}, name


def test_every_diagnostic_and_reducer_is_implemented():
    assert set(runs.DIAGNOSTICS) == set(rank.DIAGNOSTICS)
    assert set(runs.REDUCERS) == set(metrics.REDUCERS)


def test_every_data_source_and_token_dtype_the_language_reads_is_implemented():
    assert set(lang_data.SOURCES) == set(data.SOURCES)
    assert set(lang_data.TOKEN_DTYPES) == set(data.TOKEN_DTYPES)
