"""The run loop: data-parallel steps over a `DeviceGroup`, eval, checkpoints, records.

Each rank runs `RankLoop` (`sexpgpu.train.rank`) on its own thread with its own program (its
device's parameters, gradients and optimizer) and loader share::

    for each step:
        every rank:  loss and gradient summed over its microbatches
        all-reduce:  sums over this node's ranks, then over the nodes (deterministic)
        every rank:  mean over all microbatches, clip, optimizer update
        rank 0:      metrics, status, eval, checkpoint (of node 0)

On a device that queues its work (a GPU), the host reads a step's loss and
norm only once the next step's microbatches are queued, so the device
computes while the host waits, records and loads the next batch (not past a
step that evaluates or checkpoints: those run with nothing queued, as the
memory plan has them). A diverged loss still stops the run before the next
update.

The ranks' updates are identical, so their parameters stay equal; at each
checkpoint the ranks' digests are compared (E-DP-004 when they differ) and
every rank's loader position gathered. One rank is the same loop with a group
of one. With several nodes (`RuntimeConfig.nodes`) each node runs this in its
own process: the nodes meet at the rendezvous (`sexpgpu.runtime.nodes`) once
the checkpoint to resume is known, and only node 0 touches the run folder.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sexpgpu.devices.base import Program
from sexpgpu.errors import SexpgpuError
from sexpgpu.runtime.config import RuntimeConfig
from sexpgpu.runtime.memory import MemoryPlan
from sexpgpu.runtime.nodes import GradientCarry, NodeLink
from sexpgpu.train.checkpoint import Checkpoint, Location, experiment_hashes, load_checkpoint
from sexpgpu.train.data import make_loader
from sexpgpu.train.loggers import MirroredLog, open_loggers
from sexpgpu.train.metrics import MetricsLog, write_status
from sexpgpu.train.rank import RankLoop, RunContext, carry_key, params_digest
from sexpgpu.train.reports import RunSummary, StepReport
from sexpgpu.train.resume import check_identity, find_resume
from sexpgpu.train.run_folder import RECORD, RunClaim, claim_run_folder
from sexpgpu.train.settings import RunSettings
from sexpgpu.train.trained import checkpoint_folder

__all__ = ["RunSummary", "StepReport", "Trainer"]

log = logging.getLogger(__name__)


class Trainer:
    """Trains one run and writes its directory.

    Parameters
    ----------
    make_program
        ``rank -> Program`` (`sexpgpu.devices.base`): each rank gets its own, on its device.
    data
        The run's `DataDef`.
    settings
        The run's `RunSettings`.
    run_dir
        Where ``metrics.jsonl``, ``status.json`` and relative checkpoints go.
    experiment_hash
        Recorded in checkpoints and ``run.json``; a resume must match it (E-CKPT-003).
    identity
        The resolved experiment the hash is of
        (`sexpgpu.train.settings.experiment_identity`), recorded in checkpoints
        so that E-CKPT-003 names the first setting that differs.
    devices
        The ranks' devices, e.g. ``("cpu:0", "cpu:1")``.
    run_name
        The run's name: the run folder is claimed for it and the experiment
        (``run.json``), so that another's records are never mixed in.
    param_shapes
        Parameter name -> shape: a checkpoint that does not hold exactly
        these is damaged (skipped by ``--resume latest``).
    target
        The data field eval accuracy compares the output's argmax with, or None.
    plan
        One rank's memory plan: its line opens the run, its peak line ends it.
    report
        The device's lowering report (the plan's line among it), annotated at the start.
    resume
        None, ``"latest"`` or a checkpoint folder or location.
    on_step
        Called on rank 0's thread with a `StepReport` after every step.
    storage_options
        fsspec options for remote checkpoint locations.
    runtime
        The node variables (`RuntimeConfig`: node count and rank, rendezvous,
        gradient dtype, timeout); None: one node.
    sets
        The ``--set`` values, recorded in checkpoints.
    init
        Parameters a fresh run starts from instead of its initializers.
    record
        More of the run for a new ``run.json`` (``--set`` values, ``--init-from``).
    announce
        Called with the lines a user should see (the checkpoint resumed).
    shard_optimizer
        Whether each rank keeps the optimizer state of its shard alone
        (`sexpgpu.devices.shard`; the plan's choice, or ``SEXPGPU_SHARD_OPTIMIZER``).
    started
        ``time.perf_counter()`` when the run's preparation began: the first
        step's ``runtime/first_step_s`` counts from it (None: not recorded).
    prepared
        ``(phase, time.perf_counter() at its end)`` for the preparation's phases,
        in order: the first step's wait is reported by phase
        (``runtime/startup/<phase>_s``).

    Attributes
    ----------
    stop
        Set it (from a signal handler, say) to stop after the step in flight:
        the run writes a checkpoint there and ends with `RunSummary.interrupted`.
    """

    def __init__(
        self,
        make_program: Callable[[int], Program],
        data: Any,
        settings: RunSettings,
        run_dir: Path,
        *,
        experiment_hash: str,
        identity: Mapping[str, str] | None = None,
        devices: Sequence[str] = ("cpu:0",),
        run_name: str = "train",
        param_shapes: Mapping[str, tuple[int, ...]] | None = None,
        target: str | None = None,
        plan: MemoryPlan | None = None,
        report: Sequence[str] = (),
        resume: str | None = None,
        on_step: Callable[[StepReport], None] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        runtime: RuntimeConfig | None = None,
        sets: Mapping[str, Any] | None = None,
        init: Mapping[str, Any] | None = None,
        record: Mapping[str, Any] | None = None,
        announce: Callable[[str], None] | None = None,
        shard_optimizer: bool = False,
        started: float | None = None,
        prepared: Sequence[tuple[str, float]] = (),
    ) -> None:
        self.make_program, self.data, self.settings = make_program, data, settings
        self.started, self.prepared = started, tuple(prepared)
        self.runtime = runtime or RuntimeConfig()
        self.run_dir = Path(run_dir)
        self.hash = experiment_hash
        self.identity = dict(identity or {})
        self.announce = announce or (lambda line: None)
        self.stop = threading.Event()
        self.devices = tuple(devices)
        self.run_name, self.param_shapes = run_name, param_shapes
        self.target, self.plan, self.report = target, plan, tuple(report)
        self.resume, self.on_step = resume, on_step
        self.storage_options = storage_options
        self.sets = dict(sets or {})
        self.init = init
        self.record = dict(record or {})
        self.shard_optimizer = shard_optimizer
        self.location = self._location()

    def _location(self) -> Location | None:
        where = checkpoint_folder(self.run_dir, self.settings)
        return None if where is None else Location(where, self.storage_options)

    @property
    def lead_node(self) -> bool:
        """Whether this process writes the run's records (node 0)."""
        return self.runtime.node_rank == 0

    def run(self) -> RunSummary:
        """Train to ``settings.steps``; return how it ended."""
        from sexpgpu.runtime.group import DeviceGroup

        # Data and checkpoint problems surface before the run directory is touched.
        s, local = self.settings, len(self.devices)
        first, world = self.runtime.node_rank * local, self.runtime.nodes * local
        loaders = [
            make_loader(
                self.data,
                batch=s.batch,
                microbatches=s.microbatches,
                seed=s.seed,
                rank=first + rank,
                ranks=world,
            )
            for rank in range(local)
        ]
        ckpt = self._load_resume()
        if ckpt is None and self.location is not None and self.location.remote:
            self.location.steps()  # an unreachable bucket is E-CKPT-004 now, not after step N
        link = NodeLink.open(self.runtime, self._fingerprint(ckpt))  # E-DP-006, E-DP-007
        claim = self._open_folder() if self.lead_node else None
        metrics = self._open_metrics(ckpt.step if ckpt else None) if claim else _Silent()
        try:
            if claim is not None and claim.note is not None:
                log.warning("%s", claim.note)
                metrics.annotate(ckpt.step if ckpt else 0, claim.note)
            if ckpt is not None:
                metrics.annotate(ckpt.step, f"resume: from {ckpt.where}")
                for message in ckpt.skipped:
                    metrics.annotate(ckpt.step, f"checkpoint: skipped damaged {message}")
            group = DeviceGroup(self.devices)
            run = self._context(link, self._carry(ckpt, link))
            started = time.perf_counter()
            results = group.run(
                lambda ctx: RankLoop(
                    run, ctx, self.make_program(ctx.rank), loaders[ctx.rank], ckpt, metrics
                ).run()
            )
            link.barrier()  # no node leaves while another still sums
            link.close()
        except BaseException as err:
            # Ctrl-C is not a failure of the run: say so, keeping the last step and loss.
            stopped = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
            metrics.close()  # a rank still running writes no more
            if claim is not None:  # status.json ends at metrics.jsonl's last step
                self._status(metrics, state=stopped, step=metrics.last_step, loss=metrics.last_loss)
            raise
        metrics.close()
        summary: RunSummary = results[0]
        if summary.interrupted and claim is not None:
            self._status(
                metrics, state="interrupted", step=metrics.last_step, loss=metrics.last_loss
            )
        summary.seconds = time.perf_counter() - started
        summary.resumed_from = ckpt.step if ckpt else None
        return summary

    def _fingerprint(self, ckpt: Checkpoint | None) -> dict[str, Any]:
        """What every node must agree on at the rendezvous (beside the node variables)."""
        resumed = None
        if ckpt is not None:
            resumed = f"step {ckpt.step}, parameters {params_digest(ckpt.params)[:16]}"
        return {
            "experiment": self.hash,
            "steps": self.settings.steps,
            "checkpoint": resumed,
            "optimizer states sharded": self.shard_optimizer,
        }

    def _carry(self, ckpt: Checkpoint | None, link: NodeLink) -> GradientCarry:
        """This node's bf16 rounding error: from the checkpoint, so a resume is exact."""
        carry = GradientCarry()
        if ckpt is not None and link.nodes > 1 and link.gradients == "bf16":
            carry.residual = ckpt.optimizer.get(carry_key(link.node_rank))
        return carry

    def _context(self, link: NodeLink, carry: GradientCarry) -> RunContext:
        return RunContext(
            settings=self.settings,
            data=self.data,
            devices=self.devices,
            experiment_hash=self.hash,
            identity=self.identity,
            stop=self.stop,
            location=self.location,
            target=self.target,
            plan=self.plan,
            report=self.report,
            on_step=self.on_step,
            status=self._status,
            link=link,
            carry=carry,
            sets=self.sets,
            init=self.init,
            shard=self.shard_optimizer,
            started=self.started,
            prepared=self.prepared,
        )

    def _open_folder(self) -> RunClaim:
        """Make the run folder and claim it for this run (E-CKPT-005: another's records)."""
        self._folder_error(lambda: self.run_dir.mkdir(parents=True, exist_ok=True))
        hashes = experiment_hashes(self.location) if self.location is not None else set()
        return claim_run_folder(
            self.run_dir,
            self.hash,
            self.run_name,
            resume=self.resume is not None,
            checkpoint_hashes=hashes,
            record=self.record | ({"parent": self._parent} if self._parent else {}),
        )

    def _open_metrics(self, resumed: int | None) -> MetricsLog | MirroredLog:
        metrics = self._folder_error(lambda: MetricsLog(self.run_dir / "metrics.jsonl", resumed))
        if not self.settings.log:
            return metrics
        config = {"run": self.run_name, "experiment": self.hash[:12], **self.record}
        loggers = open_loggers(self.settings.log, self.run_dir, self.run_name, config)
        return MirroredLog(metrics, loggers)

    def _folder_error(self, fn: Callable[[], Any]) -> Any:
        # An --out that cannot hold a run directory is a user error.
        try:
            return fn()
        except OSError as err:
            is_file = self.run_dir.exists() and not self.run_dir.is_dir()
            reason = "it is a file" if is_file else (err.strerror or str(err))
            raise SexpgpuError(
                "E-CLI-001",
                f"cannot use {self.run_dir} as the run directory: {reason}",
                str(self.run_dir),
                hint="point --out at a new or existing folder you can write to",
            ) from None

    def _load(self, where: str, **filters: Any) -> Checkpoint:
        """A checkpoint that fits this run's model, its state complete (else skipped as damaged)."""
        return load_checkpoint(
            where, self.storage_options, expect=self.param_shapes, complete=True, **filters
        )

    def _load_resume(self) -> Checkpoint | None:
        self._parent: dict[str, Any] | None = None
        if self.resume is None:
            return None
        location = None if self.location is None else self.location.where
        ckpt = find_resume(self.resume, location, self.run_dir, self.hash, self._load)
        check_identity(ckpt, self.hash, self.identity, self.sets)
        state = ckpt.state
        here = (len(self.devices), self.runtime.nodes)
        if (state["devices"], state["nodes"]) != here:
            where = "SEXPGPU_DEVICES" if state["devices"] != here[0] else "SEXPGPU_NODES"
            raise SexpgpuError(
                "E-DP-002",
                f"checkpoint {ckpt.where} was written by {state['devices']} device(s) on "
                f"{state['nodes']} node(s); this run has {here[0]} on {here[1]}",
                where,
                hint=f"resume with {state['devices']} device(s) per node on "
                f"{state['nodes']} node(s), as the checkpoint was written",
            )
        self._check_history(ckpt)
        if not self._inside(ckpt.where):
            self._parent = {
                "folder": _run_folder_of(ckpt.where),
                "checkpoint": ckpt.where,
                "step": ckpt.step,
            }
        log.info("resume: step %d from %s", ckpt.step, ckpt.where)
        shown = ckpt.where
        if self._inside(ckpt.where) and "://" not in shown:
            shown = str(Path(ckpt.where).relative_to(self.run_dir))
        self.announce(f"resumed from {shown} (step {ckpt.step} of {self.settings.steps})")
        return ckpt

    def _check_history(self, ckpt: Checkpoint) -> None:
        """E-CKPT-006 when training on from `ckpt` would rewrite the run's history.

        That is when the run's target is below the checkpoint, or when the
        run folder holds a newer checkpoint of this experiment: the new steps
        would sit beside a trajectory they do not continue.
        """
        newer = None
        if self.location is not None:
            try:
                newest = self._load(self.location.where, experiment_hash=self.hash)
                newer = newest if newest.step > ckpt.step else None
            except SexpgpuError as err:
                if err.code != "E-CKPT-001":
                    raise
        if ckpt.step <= self.settings.steps and newer is None:
            return  # at the last step already: nothing to do, nothing rewritten
        steps = self.settings.steps
        if newer is not None:
            what = (
                f"checkpoint {ckpt.where} (step {ckpt.step}) is below step {newer.step}, the "
                f"newest in {self.location}: training on from it would fork the run's history"
            )
            cont = f"--resume latest --steps {max(steps, newer.step + 1)}"
            branch = f"--out NEW_FOLDER --resume {ckpt.where} --steps {steps}"
        else:
            what = f"checkpoint {ckpt.where} is at step {ckpt.step}, past the target step {steps}"
            cont = f"--resume latest --steps {ckpt.step + 1} or more"
            earlier = self._earlier(steps)
            branch = (
                f"--out NEW_FOLDER --resume {earlier.where} --steps {steps}"
                if earlier is not None
                else "--out NEW_FOLDER without --resume"
            )
        raise SexpgpuError(
            "E-CKPT-006",
            what,
            "--resume" if newer is not None else "--steps",
            hint=f"continue it: {cont}; or branch into a new folder: {branch}",
        )

    def _earlier(self, steps: int) -> Checkpoint | None:
        """The newest checkpoint of this experiment below step `steps`, to branch from."""
        if self.location is None:
            return None
        try:
            return self._load(self.location.where, experiment_hash=self.hash, max_step=steps - 1)
        except SexpgpuError as err:
            if err.code != "E-CKPT-001":
                raise
            return None

    def _inside(self, where: str) -> bool:
        """Whether a checkpoint lies in this run's own checkpoint location."""
        if self.location is None:
            return False
        parent = where.rstrip("/").rpartition("/")[0]
        if "://" in parent or self.location.remote:
            return parent == self.location.where
        return Path(parent).resolve() == Path(self.location.where).resolve()

    def _status(self, metrics: MetricsLog, **fields: Any) -> None:
        # Fields not given keep their last written value, so a final "failed" or
        # "interrupted" still says how far the run got.
        defaults: dict[str, Any] = {"step": 0, "steps": self.settings.steps, "loss": None}
        defaults |= {"tokens_per_s": 0.0, "eta_s": None}
        self._last_status = getattr(self, "_last_status", defaults) | fields
        try:
            write_status(self.run_dir / "status.json", **self._last_status)
        except OSError:  # the run's own error matters more
            log.warning("could not write %s", self.run_dir / "status.json")


def _run_folder_of(where: str) -> str | None:
    """The run folder a checkpoint ``.../step-N`` belongs to: the nearest with a run.json."""
    if "://" in where:
        return None
    for folder in list(Path(where).resolve().parents)[:3]:
        if (folder / RECORD).is_file():
            return str(folder)
    return None


class _Silent:
    """The records of a node other than node 0: it writes none."""

    last_step = 0
    last_loss = None

    def write(self, step: int, name: str, value: Any) -> None:
        """Nothing: node 0 writes the records."""

    def annotate(self, step: int, text: str) -> None:
        """Nothing: node 0 writes the records."""

    def close(self) -> None:
        """Nothing to close."""
