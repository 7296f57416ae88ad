"""The update-rule table: each optimizer's arithmetic, keyed by (optimizer, backend).

An optimizer (`sexpgpu.devices.optim`) holds its options and moments; what
one step does to the arrays is its update rule, registered here by
`update_rule` the way ops' lowerings are. The ``"numpy"`` rule of each
optimizer is the reference (`sexpgpu.devices.update_numpy`); every other
backend's rule is tested against it: ``"torch"`` (PyTorch tensors, on any
of its devices, `sexpgpu.devices.cuda.update_torch`) and ``"triton"`` (one
kernel launch on a GPU, `sexpgpu.devices.cuda.adamw`). An `ArrayOps` names
the backends it runs, best first (`ArrayOps.backends`); an optimizer takes
the first one that has a rule.

A rule reads every number that changes from step to step (learning rates,
the step count, the gradients' factor) from `Update.numbers` and
`Update.scale`, which the stream gave (`sexpgpu.devices.stream`): host
numbers on the cpu device, device scalars on a GPU, refilled in place each
step. So every rule can be captured once and replayed.

A rule may also register its scratch: the bytes it holds beyond the
parameters, gradients and moments while it runs (or keeps between steps,
such as launch tables), as a function of the parameters' shapes. The
memory plan counts the largest scratch among the backends that may run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sexpgpu.devices.arrays import ArrayOps
from sexpgpu.devices.stream import Stream

__all__ = [
    "UPDATE_RULES",
    "UPDATE_SCRATCH",
    "Scratch",
    "Update",
    "UpdateRule",
    "rule_for",
    "scratch_bytes",
    "update_rule",
]


@dataclass(frozen=True)
class Update:
    """One step of an optimizer over its parameters, as an update rule receives it.

    Attributes
    ----------
    params, grads
        The parameters (updated in place) and their gradients, in one order.
    moments
        Moment name -> one array per parameter (None where the moment does
        not cover that parameter), updated in place.
    decay, hidden
        Per parameter: whether weight decay applies, and whether it is a
        hidden weight matrix (`sexpgpu.ir.compile.hidden_matrices`).
    numbers
        The step's numbers by name (``lr``, ``step``...): host numbers or
        device scalars, from `Stream.scalars`.
    scale
        None, or what every gradient is multiplied by as it is read: the
        clipping factor over the microbatch count (a host number or a
        device scalar).
    options
        The optimizer's options (host constants: betas, momentum...).
    xp, stream
        The backend's arrays and stream.
    keep
        What the rule keeps from one step to the next (launch tables, say):
        one dict per optimizer.
    """

    params: Sequence[Any]
    grads: Sequence[Any]
    moments: Mapping[str, Sequence[Any]]
    decay: Sequence[bool]
    hidden: Sequence[bool]
    numbers: Mapping[str, Any]
    scale: Any
    options: Mapping[str, Any]
    xp: ArrayOps
    stream: Stream
    keep: dict[str, Any] = field(default_factory=dict)

    def select(self, which: Sequence[bool], **numbers: Any) -> Update:
        """The parameters where `which` holds (their moments with them), `numbers` changed."""
        assert len(which) == len(self.params)

        def pick(xs: Sequence[Any]) -> list[Any]:
            return [x for x, keep in zip(xs, which, strict=True) if keep]

        return replace(
            self,
            params=pick(self.params),
            grads=pick(self.grads),
            moments={k: pick(v) for k, v in self.moments.items()},
            decay=pick(self.decay),
            hidden=pick(self.hidden),
            numbers={**self.numbers, **numbers},
        )


UpdateRule = Callable[[Update], None]
Scratch = Callable[[Sequence[tuple[int, ...]]], int]  # parameters' shapes -> bytes

# (optimizer name as users type it, backend) -> the rule, and its scratch where it has some
UPDATE_RULES: dict[tuple[str, str], UpdateRule] = {}
UPDATE_SCRATCH: dict[tuple[str, str], Scratch] = {}


def update_rule(
    optimizer: str, backend: str, scratch: Scratch | None = None
) -> Callable[[UpdateRule], UpdateRule]:
    """Register a function as `optimizer`'s update rule on `backend`, with its `scratch`."""

    def register(rule: UpdateRule) -> UpdateRule:
        assert (optimizer, backend) not in UPDATE_RULES, (optimizer, backend)
        UPDATE_RULES[optimizer, backend] = rule
        if scratch is not None:
            UPDATE_SCRATCH[optimizer, backend] = scratch
        return rule

    return register


def scratch_bytes(
    optimizer: str, backends: Sequence[str], shapes: Sequence[tuple[int, ...]]
) -> int:
    """The most scratch `optimizer`'s rules on `backends` hold for parameters of `shapes`."""
    counts = [
        UPDATE_SCRATCH[optimizer, b](shapes) for b in backends if (optimizer, b) in UPDATE_SCRATCH
    ]
    return max(counts, default=0)


def rule_for(optimizer: str, backends: Sequence[str]) -> UpdateRule:
    """`optimizer`'s rule on the first of `backends` that has one."""
    for backend in backends:
        rule = UPDATE_RULES.get((optimizer, backend))
        if rule is not None:
            return rule
    raise AssertionError(f"no update rule of {optimizer} on any of {list(backends)}")
