"""Every name a user types is defined once; execution keys its implementations by it.

The language holds the tables of optimizers, schedules, diagnostics, reducers
and data sources; the runtime holds the device names (devices and tn may not
import the language). Execution's registries cannot import those tables
without breaking the import direction, so this test is the link.
"""

import argparse
import inspect

from sexpgpu.commands import explain, run
from sexpgpu.devices import optim
from sexpgpu.devices.base import DEVICES
from sexpgpu.devices.collectives import LOCAL_SUMS
from sexpgpu.lang import data as lang_data
from sexpgpu.lang import runs
from sexpgpu.runtime.devices import DEVICE_KINDS
from sexpgpu.tn import args as tn_args
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


def _device_choices(add_arguments) -> set[str]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    (action,) = [a for a in parser._actions if "--device" in a.option_strings]
    return set(action.choices)


def test_every_device_name_is_implemented_and_offered():
    assert set(DEVICES) == set(DEVICE_KINDS)
    assert set(LOCAL_SUMS) == set(DEVICE_KINDS)
    assert set(tn_args.DEVICES.values()) == set(DEVICE_KINDS)
    for command in (run, explain):
        assert _device_choices(command.add_arguments) == set(DEVICE_KINDS), command


def test_every_logger_the_language_names_is_implemented_and_offered():
    from sexpgpu.train import loggers

    assert set(runs.LOGGERS) == set(loggers.LOGGERS)
    parser = argparse.ArgumentParser()
    run.add_arguments(parser)
    log = next(a for a in parser._actions if a.dest == "log")
    assert tuple(log.choices) == runs.LOGGERS
