"""One rank's share of a run: its program (on its device), loader share and records.

`RankLoop.run` is what each thread of the `DeviceGroup` executes (see
`sexpgpu.train.loop` for the step). The rank's parameters, gradients and
optimizer live on its device, inside the `sexpgpu.devices.base.Program`;
this loop only sequences the step and sees the loss and metrics. Rank 0 of
node 0 also writes the records: metrics, status, evaluations and
checkpoints. With several nodes, rank 0 of each node speaks for its node
over the `NodeLink`: the step's small numbers, and at checkpoints the
digests, loader positions and bf16 rounding errors.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sexpgpu.devices.base import HostState, Program
from sexpgpu.devices.collectives import Comms
from sexpgpu.errors import SexpgpuError
from sexpgpu.runtime.memory import MemoryPlan
from sexpgpu.runtime.nodes import GradientCarry, NodeLink
from sexpgpu.train.checkpoint import Checkpoint, Location, save_checkpoint
from sexpgpu.train.data import Loader
from sexpgpu.train.evaluate import evaluate_batches
from sexpgpu.train.metrics import REDUCERS, MetricsLog
from sexpgpu.train.reports import RunSummary, StepReport
from sexpgpu.train.schedules import make_schedule
from sexpgpu.train.settings import RunSettings

__all__ = ["DIAGNOSTICS", "RankLoop", "RunContext", "carry_key", "params_digest"]

log = logging.getLogger(__name__)

_STATUS_EVERY_S = 1.0  # status.json at most this often (and at the end)


@dataclass(frozen=True)
class _Queued:
    """A step whose update is queued on the device and whose numbers the host has not read."""

    step: int
    loss: Any  # device scalars (or host numbers): read with float
    norm: Any
    lr: float
    locals: list[dict[str, Any]]  # every rank's peak, events and local diagnostics
    due: list[Any]  # the diagnostics due at this step
    batches: list[dict[str, np.ndarray]]
    stop: bool = False  # the run stops after this step (every rank agrees)


@dataclass(frozen=True)
class RunContext:
    """What every rank of one run shares, fixed before the ranks start.

    Attributes
    ----------
    settings
        The run's settings.
    data
        The data definition (its ``name`` and ``kind`` are annotated).
    devices
        The ranks' devices, e.g. ``("cpu:0", "cpu:1")``.
    experiment_hash
        Recorded in checkpoints.
    identity
        The resolved experiment, recorded in checkpoints beside its hash.
    stop
        Set to stop after the step in flight, with a checkpoint there.
    location
        Where checkpoints go, or None.
    target
        The data field eval accuracy compares the output's argmax with.
    plan
        The memory plan of one rank, or None when the program plans none.
    report
        The device's lowering report, annotated at the start.
    on_step
        Progress callback (rank 0's thread).
    status
        Writes ``status.json`` (fields not given keep their last value).
    link
        This node's link to the others (a link to itself on one node).
    carry
        This node's bf16 rounding error, summed into its next contribution.
    sets
        The ``--set`` values, recorded in checkpoints.
    init
        The parameters a fresh run starts from (``--init-from``), or None.
    shard
        Whether each rank keeps the optimizer state of its shard alone
        (`sexpgpu.devices.shard`): checkpoints gather it on rank 0.
    started
        ``time.perf_counter()`` when the run's preparation began (the
        command's start): the first step's ``runtime/first_step_s`` counts
        from it. None: not recorded.
    prepared
        ``(phase, time.perf_counter() at its end)`` for the preparation's
        phases (``front end``, ``plan``), in order: the first step's wait
        is split by them (`startup`).
    """

    settings: RunSettings
    data: Any
    devices: tuple[str, ...]
    experiment_hash: str
    identity: Mapping[str, str]
    stop: threading.Event
    location: Location | None
    target: str | None
    plan: MemoryPlan | None
    report: tuple[str, ...]
    on_step: Callable[[StepReport], None] | None
    status: Callable[..., None]
    link: NodeLink = field(default_factory=NodeLink)
    carry: GradientCarry | None = None
    sets: Mapping[str, Any] = field(default_factory=dict)
    init: Mapping[str, np.ndarray] | None = None
    shard: bool = False
    started: float | None = None
    prepared: tuple[tuple[str, float], ...] = ()


def carry_key(node: int) -> str:
    """The checkpoint's name for node `node`'s bf16 rounding error (in optimizer.safetensors)."""
    return f"carry/node-{node}"


def params_digest(params: Mapping[str, np.ndarray]) -> str:
    """sha256 over the arrays' names and bytes, in name order."""
    h = hashlib.sha256()
    for k in sorted(params):
        h.update(k.encode())
        h.update(np.ascontiguousarray(params[k]).tobytes())
    return h.hexdigest()


class RankLoop:
    """One rank's share of a run (rank 0 also writes the records)."""

    def __init__(
        self,
        run: RunContext,
        ctx: Any,
        program: Program,
        loader: Loader,
        ckpt: Checkpoint | None,
        metrics: MetricsLog,
    ) -> None:
        s = run.settings
        self.run_ctx, self.ctx, self.s, self.metrics = run, ctx, s, metrics
        self.link = run.link
        self.comms = Comms(ctx, run.link, run.carry if run.carry is not None else GradientCarry())
        self.lead = ctx.rank == 0 and run.link.node_rank == 0
        self.speaker = ctx.rank == 0 and run.link.nodes > 1  # this node's voice to the others
        self.program = program
        self.loader = loader
        shard_over = self.comms if run.shard else None
        if ckpt is None:
            self.start = 0
            first = None if run.init is None else HostState(dict(run.init))
            program.start(s.optimizer, seed=s.seed, state=first, shard_over=shard_over)
        else:
            self.start = ckpt.step
            state = HostState(ckpt.params, ckpt.optimizer, ckpt.state["optimizer"])
            program.start(s.optimizer, seed=s.seed, state=state, shard_over=shard_over)
            self.loader.restore(ckpt.state["loaders"][self.comms.rank])
        self._loaded = time.perf_counter()  # the parameters are on the device: loading ends
        self.schedule = make_schedule(s.schedule, s.optimizer.options["lr"], s.steps)
        self.diagnostics = self._diagnostics()
        self.peak, self.per_s = 0, 0.0  # the run's highest peak_bytes; the last tokens/s
        self._first: float | None = None  # seconds from the run's start to its first step's end
        self.last: dict[str, float | None] = {
            "loss": None,
            "eval_loss": None,
            "eval_accuracy": None,
            "eval_step": None,
        }

    def _diagnostics(self) -> list[Any]:
        chosen = []
        for d in self.s.diagnostics:
            if d.name == "activation-rms" and not self.program.has_activations:
                text = "diagnostics: activation-rms skipped: the program exposes no activations"
                if self.lead:
                    log.warning(text)
                    self.metrics.annotate(self.start, text)
                continue
            chosen.append(d)
        return chosen

    # -- the loop -------------------------------------------------------------------------

    def run(self) -> RunSummary:
        # A diverging run overflows in NumPy's arithmetic before its loss is NaN:
        # E-TRAIN-002 reports it, at the step it shows, without NumPy's warnings first.
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            return self._steps()

    def _steps(self) -> RunSummary:
        s = self.s
        if self.lead:
            self._annotate_start()
        times: list[float] = []
        began = time.perf_counter()
        queued: _Queued | None = None
        for index in range(self.start, s.steps):
            # On a device that queues, the next step's microbatches are queued before
            # the host reads the last step's numbers, so the device computes while
            # the host waits and records (a device that computes as called gains
            # nothing, and its step times would shift by a step).
            if queued is not None and not self._queue_behind(queued.step):
                began, queued = self._conclude(queued, began, times), None
            batches = self.loader.next_step()
            for batch in batches:
                self.program.accumulate(batch)
            if queued is not None:
                began = self._conclude(queued, began, times)
            queued = self._update(index, batches)
            if queued.stop:
                break
        if queued is not None:
            self._conclude(queued, began, times)
        interrupted = queued is not None and queued.stop and queued.step < s.steps
        if interrupted:
            self._interrupted(queued.step)
        elif self.lead:
            self._finish()
        return RunSummary(
            step=queued.step if interrupted else max(self.start, s.steps),
            loss=self.last["loss"],
            eval_loss=self.last["eval_loss"],
            eval_accuracy=self.last["eval_accuracy"],
            seconds=0.0,
            params=self._final_params(),
            memory=self._peak_line(),
            interrupted=interrupted,
        )

    def _final_params(self) -> dict[str, np.ndarray]:
        """Rank 0's parameters on the host (results[0] is kept); every rank takes part."""
        self.program.gather_params()
        return self.program.host_params() if self.ctx.rank == 0 else {}

    def _interrupted(self, step: int) -> None:
        """Stopped after `step` (SIGINT, SIGTERM): a checkpoint there, so nothing is lost."""
        if not self._checkpoints(step):
            self._checkpoint(step)
        if self.lead:
            where = "" if self.run_ctx.location is not None else " (no :checkpoint location)"
            self.metrics.annotate(step, f"interrupted after step {step}{where}")

    def _queue_behind(self, step: int) -> bool:
        """Whether the next step may be queued before `step`'s numbers are read.

        Not on a device that computes as called, and not past a step that
        evaluates, checkpoints or samples activations: those need the
        device's memory, and the plan holds one of them at a time.
        """
        host_work = (
            self._eval_due(step)  # on every rank: each may gather parameters for it
            or self._checkpoints(step)
            or any(d.name == "activation-rms" and step % d.every == 0 for d in self.diagnostics)
        )
        return bool(self.program.asynchronous) and not host_work

    def _evaluates(self, step: int) -> bool:
        return self._eval_due(step) and self.lead

    def _eval_due(self, step: int) -> bool:
        """Whether the run evaluates after `step` (on the lead; every rank knows)."""
        every = self.s.eval_every
        return bool(every and (step % every == 0 or step == self.s.steps))

    def _checkpoints(self, step: int) -> bool:
        every = self.s.checkpoint_every
        return bool(every and (step % every == 0 or step == self.s.steps))

    def _update(self, index: int, batches: list[dict[str, np.ndarray]]) -> _Queued:
        """The rest of step `index` once its microbatches are summed: all-reduce, mean, update.

        Queued on the device: the loss and the norm are read by `_conclude`.
        """
        program = self.program
        step = index + 1
        local = {"peak": program.take_peak(), "events": list(program.events)}
        local["stop"] = self.run_ctx.stop.is_set()
        program.events.clear()
        due = [d for d in self.diagnostics if step % d.every == 0]
        if any(d.name == "grad-norm" for d in due):
            local["grad-norm"] = program.local_grad_norm()
        loss = program.reduce(self.comms, self.s.microbatches)
        locals_ = self.ctx.allgather(local)
        if self.speaker:
            locals_ = [x for node in self.link.allgather(locals_) for x in node]
        stop = any(x["stop"] for x in locals_)
        if self.link.nodes > 1:  # only rank 0 heard the other nodes
            stop = self.ctx.broadcast(stop, root=0)
        lr = self.schedule(index)
        norm = program.update(lr, self.s.clip)
        return _Queued(step, loss, norm, lr, locals_, due, batches, stop)

    def _conclude(self, queued: _Queued, began: float, times: list[float]) -> float:
        """Read a queued step's numbers, record them, evaluate and checkpoint where due.

        A diverged run stops here, before the next update, and no checkpoint
        holds it. Nothing is queued behind a step that evaluates or
        checkpoints (`_queue_behind`), so both see the state after its
        update and the loader where the step left it. Returns when the next
        step's time starts.
        """
        step = queued.step
        loss, norm = float(queued.loss), float(queued.norm)  # the device's step ends here
        elapsed = time.perf_counter() - began
        if not math.isfinite(loss):
            raise SexpgpuError(
                "E-TRAIN-002",
                f"the loss is {loss} at step {step}",
                self.s.optimizer.span,
                hint="lower :lr, add :clip 1.0, or add warmup to the schedule",
            )
        locals_ = queued.locals
        extras = {"peak": max(x["peak"] for x in locals_), "diagnostics": {}}
        extras["events"] = [line for x in locals_ for line in x["events"]]
        if self._eval_due(step) or any(d.name == "activation-rms" for d in queued.due):
            self.program.gather_params()  # every rank: the lead reads every f32 parameter
        for d in queued.due:
            extras["diagnostics"] |= DIAGNOSTICS[d.name](self, d, queued)
        times.append(elapsed)
        next_began = time.perf_counter()
        if self.lead:
            self._record(step, loss, norm, queued.lr, elapsed, times, extras)
        if self._evaluates(step):
            self._evaluate(step)
        if self._checkpoints(step):
            self._checkpoint(step)
        if self.lead and self.run_ctx.on_step is not None:
            self.run_ctx.on_step(self._report(step, loss, queued.lr, norm, elapsed, times))
        # Time spent evaluating or checkpointing is no step's.
        return next_began if self._queue_behind(step) else time.perf_counter()

    # -- records (rank 0) -----------------------------------------------------------------

    def _annotate_start(self) -> None:
        run, m, step = self.run_ctx, self.metrics, self.start
        m.annotate(step, f"devices: {len(run.devices)} x {self.ctx.device.kind}")
        if self.link.nodes > 1:
            m.annotate(
                step,
                f"nodes: {self.link.nodes}, {len(run.devices)} device(s) each; "
                f"gradients between nodes in {self.link.gradients}",
            )
        for line in run.report:
            m.annotate(step, line)
        m.annotate(
            step,
            f"data: {run.data.name} ({run.data.kind}), "
            + ("" if self.loader.layout == run.data.kind else f"{self.loader.layout}, ")
            + f"{self.loader.items_per_microbatch} items per microbatch",
        )

    def _record(
        self,
        step: int,
        loss: float,
        norm: float,
        lr: float,
        elapsed: float,
        times: list[float],
        extras: dict[str, Any],
    ) -> None:
        per_s = self.loader.items_per_microbatch * self.s.microbatches / max(elapsed, 1e-9)
        w = self.metrics.write
        w(step, "train/loss", loss)
        w(step, "train/lr", lr)
        w(step, "train/grad_norm", norm)
        w(step, "train/step_time_s", elapsed)
        w(step, "train/tokens_per_s", per_s)
        w(step, "runtime/peak_bytes", extras["peak"])
        first = self._first_step_s(step)
        if first is not None:  # compiling and loading included: what a user waits
            w(step, "runtime/first_step_s", first)
            for phase, seconds in self._startup():
                w(step, f"runtime/startup/{phase.replace(' ', '_')}_s", seconds)
        for line in extras["events"]:
            self.metrics.annotate(step, line)
        for name, value in extras["diagnostics"].items():
            w(step, f"diag/{name}", value)
        self.last["loss"], self.per_s = loss, per_s
        self.peak = max(self.peak, extras["peak"])
        now = time.monotonic()
        if step == self.s.steps or now - getattr(self, "_status_at", 0.0) >= _STATUS_EVERY_S:
            self._status_at = now
            self.run_ctx.status(
                self.metrics,
                step=step,
                loss=loss,
                tokens_per_s=per_s,
                eta_s=_eta(times, self.s.steps - step),
                state="running",
            )

    def _evaluate(self, step: int) -> None:
        batches = self.loader.eval_batches(self.s.eval_batches)
        result = evaluate_batches(self.program, batches, self.run_ctx.target)
        self.last["eval_loss"], self.last["eval_step"] = result.loss, step
        self.metrics.write(step, "eval/loss", self.last["eval_loss"])
        if result.accuracy is not None:
            self.last["eval_accuracy"] = result.accuracy
            self.metrics.write(step, "eval/accuracy", self.last["eval_accuracy"])

    def _report(
        self, step: int, loss: float, lr: float, norm: float, elapsed: float, times: list[float]
    ) -> StepReport:
        return StepReport(
            step=step,
            steps=self.s.steps,
            loss=loss,
            lr=lr,
            grad_norm=norm,
            tokens_per_s=self.loader.items_per_microbatch
            * self.s.microbatches
            / max(elapsed, 1e-9),
            step_time_s=elapsed,
            eta_s=_eta(times, self.s.steps - step) or 0.0,
            eval_loss=self.last["eval_loss"],
            eval_accuracy=self.last["eval_accuracy"],
            eval_step=self.last["eval_step"],
            unit=self.loader.item_unit,
            first_step_s=self._first_step_s(step),
            startup=self._startup() if step == self.start + 1 else (),
        )

    def _first_step_s(self, step: int) -> float | None:
        """Seconds from the run's start to the end of its first step, at that step; else None."""
        started = self.run_ctx.started
        if started is None or step != self.start + 1:
            return None
        if self._first is None:
            self._first = time.perf_counter() - started
        return self._first

    def _startup(self) -> tuple[tuple[str, float], ...]:
        """The first step's wait by phase: the preparation's, ``load``, the ``step`` itself."""
        started = self.run_ctx.started
        if started is None or self._first is None or not self.run_ctx.prepared:
            return ()
        ends = [
            *self.run_ctx.prepared,
            ("load", self._loaded),
            ("step", started + self._first),
        ]
        found, before = [], started
        for phase, end in ends:
            found.append((phase, max(0.0, end - before)))
            before = end
        return tuple(found)

    def _peak_line(self) -> str | None:
        plan = self.run_ctx.plan
        return plan.peak_line(self.peak) if plan is not None and plan.total and self.peak else None

    def _finish(self) -> None:
        line = self._peak_line()
        if line is not None:
            self.metrics.annotate(self.s.steps, line)
        self.run_ctx.status(
            self.metrics,
            step=max(self.start, self.s.steps),
            loss=self.last["loss"],
            tokens_per_s=self.per_s,
            eta_s=0.0,
            state="done",
        )

    # -- checkpoints (every rank takes part) ---------------------------------------------

    def _checkpoint(self, step: int) -> None:
        host = self.program.host_state()
        # Parameters and optimizer moments: ranks that disagree in either would drift apart
        # (sharded, each moment lives on one rank: the parameters alone can disagree).
        kept = {} if self.run_ctx.shard else host.moments
        mine = {"loader": self.loader.state(), "digest": params_digest(host.params | kept)}
        everyone = self.ctx.gather(mine, root=0)
        location = self.run_ctx.location
        if self.ctx.rank != 0 or location is None:  # the same on every node
            return
        carries = self._node_carries()
        if self.speaker:
            everyone = [x for node in self.link.allgather(everyone) for x in node]
        digests = {x["digest"] for x in everyone}
        if len(digests) > 1:  # every node's rank 0 sees it: every node stops
            who = "nodes' or ranks'" if self.link.nodes > 1 else "ranks'"
            raise SexpgpuError(
                "E-DP-004",
                f"the {who} parameters or optimizer states differ at step {step}; "
                "checkpoint not written",
                str(location),
                hint="a device computed differently; rerun with SEXPGPU_DEBUG=1 and report it; "
                "`--resume latest` continues from the checkpoint before",
            )
        if not self.lead:
            return
        state = {
            "format": 1,
            "experiment_hash": self.run_ctx.experiment_hash,
            "experiment": dict(self.run_ctx.identity),
            "optimizer": host.optimizer,
            "loaders": [x["loader"] for x in everyone],
            "devices": self.ctx.size,
            "nodes": self.link.nodes,
            "node_gradients": self.link.gradients,
            "device": self.ctx.device.kind,
        }
        if self.run_ctx.sets:
            state["sets"] = dict(self.run_ctx.sets)
        tensors = dict(host.moments)
        for node, residual in enumerate(carries or []):
            tensors[carry_key(node)] = residual
        ckpt = Checkpoint(step, host.params, tensors, state)
        where = save_checkpoint(location, ckpt)
        self.metrics.annotate(step, f"checkpoint: {where}")

    def _node_carries(self) -> list[np.ndarray] | None:
        """Every node's bf16 rounding error on node 0 (host arrays); None without."""
        if not self.speaker or self.link.gradients != "bf16":
            return None
        residual = self.comms.carry.residual
        if residual is None:  # no sum yet; the same on every node
            return None
        return self.link.gather(residual)


def _grad_norm(loop: RankLoop, d: Any, queued: _Queued) -> dict[str, float]:
    """Every rank's gradient norm (sampled in `_update`), folded by the reducer."""
    return {d.name: REDUCERS[d.reduce]([x["grad-norm"] for x in queued.locals])}


def _activation_rms(loop: RankLoop, d: Any, queued: _Queued) -> dict[str, float]:
    """Rank 0 samples activations: one microbatch is a fair sample."""
    if not loop.lead:
        return {}
    values = loop.program.activation_rms(queued.batches[0])
    return {f"{d.name}/{k}": float(v) for k, v in values.items()}


# name as users type it (the language's table) -> its values at a step that samples it
DIAGNOSTICS: dict[str, Callable[[RankLoop, Any, _Queued], dict[str, float]]] = {
    "grad-norm": _grad_norm,
    "activation-rms": _activation_rms,
}


def _eta(times: list[float], remaining: int) -> float | None:
    recent = times[-20:]
    return sum(recent) / len(recent) * remaining if recent else None
