"""The experiment language: reader, forms, variants.

The layers above use this package through these names::

    from sexpgpu.lang import load_experiment, Experiment, RunDef, Symbol, ...

`read`/`read_file` give syntax nodes with spans (`sexpgpu.lang.syntax`);
`load_experiment` checks the forms and applies a variant
(`sexpgpu.lang.experiment`); the definitions it returns are in
`sexpgpu.lang.definitions`. docs/language.md is the user's guide.
"""

from sexpgpu.lang.definitions import (
    CheckpointSpec,
    DataDef,
    DiagnosticSpec,
    EvalSpec,
    FnDef,
    ModelDef,
    OptimizerSpec,
    RunDef,
    ScheduleSpec,
)
from sexpgpu.lang.experiment import Experiment, load_experiment, load_experiment_text
from sexpgpu.lang.reader import read, read_file
from sexpgpu.lang.syntax import Keyword, ListNode, Literal, Node, Symbol, Vector, unparse

__all__ = [
    "CheckpointSpec",
    "DataDef",
    "DiagnosticSpec",
    "EvalSpec",
    "Experiment",
    "FnDef",
    "Keyword",
    "ListNode",
    "Literal",
    "ModelDef",
    "Node",
    "OptimizerSpec",
    "RunDef",
    "ScheduleSpec",
    "Symbol",
    "Vector",
    "load_experiment",
    "load_experiment_text",
    "read",
    "read_file",
    "unparse",
]
