"""One rank's share of a run: its program, loader share, parameters and optimizer.

`RankLoop.run` is what each thread of the `DeviceGroup` executes (see
`sexpgpu.train.loop` for the step). Rank 0 also writes the records: metrics,
status, evaluations and checkpoints.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from sexpgpu.errors import SexpgpuError
from sexpgpu.train.checkpoint import Checkpoint, save_checkpoint
from sexpgpu.train.data import Loader
from sexpgpu.train.metrics import REDUCERS, MetricsLog
from sexpgpu.train.optim import Optimizer, clip_by_global_norm, global_norm, make_optimizer
from sexpgpu.train.reports import RunSummary, StepReport
from sexpgpu.train.schedules import make_schedule

if TYPE_CHECKING:
    from sexpgpu.train.loop import Trainer

__all__ = ["DIAGNOSTICS", "RankLoop"]

log = logging.getLogger(__name__)

DIAGNOSTICS = ("grad-norm", "activation-rms")
_STATUS_EVERY_S = 1.0  # status.json at most this often (and at the end)


def _digest(params: Mapping[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for k in sorted(params):
        h.update(k.encode())
        h.update(np.ascontiguousarray(params[k]).tobytes())
    return h.hexdigest()


class RankLoop:
    """One rank's share of a run (rank 0 also writes the records)."""

    def __init__(
        self,
        trainer: Trainer,
        ctx: Any,
        loader: Loader,
        ckpt: Checkpoint | None,
        metrics: MetricsLog,
    ) -> None:
        s = trainer.settings
        self.t, self.ctx, self.s, self.metrics = trainer, ctx, s, metrics
        self.lead = ctx.rank == 0
        self.program = trainer.make_program(ctx.rank)
        self.loader = loader
        info = self.program.params
        self.optimizer: Optimizer = make_optimizer(
            s.optimizer,
            {k: tuple(p.shape) for k, p in info.items()},
            {k: bool(getattr(p, "decay", True)) for k, p in info.items()},
        )
        self.schedule = make_schedule(s.schedule, self.optimizer.lr, s.steps)
        self.rng = np.random.default_rng(s.seed)  # for stochastic ops; saved and restored
        if ckpt is None:
            self.start = 0
            self.params = {
                k: np.array(v, np.float32) for k, v in self.program.init_params(s.seed).items()
            }
        else:
            self.start = ckpt.step
            self.params = {k: np.array(v, np.float32) for k, v in ckpt.params.items()}
            self.optimizer.load(ckpt.optimizer, ckpt.state["optimizer"])
            self.loader.restore(ckpt.state["loaders"][ctx.rank])
            self.rng.bit_generator.state = ckpt.state["rng"]
        self.diagnostics = self._diagnostics()
        self.peak, self.per_s = 0, 0.0  # the run's highest peak_bytes; the last tokens/s
        self.last: dict[str, float | None] = {
            "loss": None,
            "eval_loss": None,
            "eval_accuracy": None,
            "eval_step": None,
        }

    def _diagnostics(self) -> list[Any]:
        chosen = []
        for d in self.s.diagnostics:
            if d.name not in DIAGNOSTICS:
                raise SexpgpuError(
                    "E-TRAIN-001",
                    f"unknown diagnostic `{d.name}`",
                    getattr(d, "span", None),
                    hint=f"use one of {', '.join(DIAGNOSTICS)}",
                )
            reduce = getattr(d, "reduce", None) or "mean"
            if reduce not in REDUCERS:
                raise SexpgpuError(
                    "E-TRAIN-001",
                    f"diagnostic {d.name}: unknown :reduce {reduce}",
                    getattr(d, "span", None),
                    hint=f"use one of {', '.join(REDUCERS)}",
                )
            if d.name == "activation-rms" and not hasattr(self.program, "activation_rms"):
                text = "diagnostics: activation-rms skipped: the program exposes no activations"
                if self.lead:
                    log.warning(text)
                    self.metrics.annotate(self.start, text)
                continue
            chosen.append(d)
        return chosen

    # -- the loop -------------------------------------------------------------------------

    def run(self) -> RunSummary:
        s = self.s
        if self.lead:
            self._annotate_start()
        times: list[float] = []
        for index in range(self.start, s.steps):
            began = time.perf_counter()
            loss, norm, lr, extras = self._step(index)
            step = index + 1
            elapsed = time.perf_counter() - began
            times.append(elapsed)
            if self.lead:
                self._record(step, loss, norm, lr, elapsed, times, extras)
            if s.eval_every and (step % s.eval_every == 0 or step == s.steps) and self.lead:
                self._evaluate(step)
            if s.checkpoint_every and (step % s.checkpoint_every == 0 or step == s.steps):
                self._checkpoint(step)
            if self.lead and self.t.on_step is not None:
                self.t.on_step(self._report(step, loss, lr, norm, elapsed, times))
        if self.lead:
            self._finish(times)
        return RunSummary(
            step=max(self.start, s.steps),
            loss=self.last["loss"],
            eval_loss=self.last["eval_loss"],
            eval_accuracy=self.last["eval_accuracy"],
            seconds=0.0,
            params=self.params,
        )

    def _step(self, index: int) -> tuple[float, float, float, dict[str, Any]]:
        """One optimizer step: local sums, all-reduce, mean, clip, update."""
        batches = self.loader.next_step()
        loss_sum, grads, peak = 0.0, None, 0
        for batch in batches:
            loss, g = self.program.train_step(self.params, batch)
            peak = max(peak, int(getattr(self.program, "last_peak_bytes", 0)))
            loss_sum += float(loss)
            if grads is None:
                grads = {k: np.array(v, np.float32) for k, v in g.items()}
            else:
                for k, v in g.items():
                    grads[k] += v
        step = index + 1
        local = {"peak": peak}
        due = [d for d in self.diagnostics if step % d.every == 0]
        if any(d.name == "grad-norm" for d in due):
            local["grad-norm"] = global_norm(grads) / len(batches)
        total = self.ctx.all_reduce({"loss": np.float64(loss_sum), "grads": grads})
        locals_ = self.ctx.allgather(local)
        m = self.s.microbatches
        grads = {k: v / np.float32(m) for k, v in total["grads"].items()}
        loss = float(total["loss"]) / m
        if not math.isfinite(loss):
            raise SexpgpuError(
                "E-TRAIN-002",
                f"the loss is {loss} at step {step}",
                getattr(self.s.optimizer, "span", None),
                hint="lower :lr, add :clip 1.0, or add warmup to the schedule",
            )
        if self.s.clip is not None:
            norm = clip_by_global_norm(grads, float(self.s.clip))
        else:
            norm = global_norm(grads)
        lr = self.schedule(index)
        self.optimizer.step(self.params, grads, lr)
        extras = {"peak": max(x["peak"] for x in locals_), "diagnostics": {}}
        for d in due:
            if d.name == "grad-norm":
                values = [x["grad-norm"] for x in locals_]
                extras["diagnostics"][d.name] = REDUCERS[d.reduce or "mean"](values)
            elif d.name == "activation-rms" and self.lead:
                extras["diagnostics"] |= self._activation_rms(batches[0], d)
        return loss, norm, lr, extras

    def _activation_rms(self, batch: Mapping[str, np.ndarray], d: Any) -> dict[str, float]:
        # Only rank 0 samples activations: one microbatch is a fair sample.
        values = self.program.activation_rms(self.params, batch)
        return {f"{d.name}/{k}": float(v) for k, v in values.items()}

    # -- records (rank 0) -----------------------------------------------------------------

    def _annotate_start(self) -> None:
        planned = int(getattr(self.program, "planned_peak_bytes", 0))
        m, step = self.metrics, self.start
        m.annotate(step, f"devices: {len(self.t.devices)} x {self.ctx.device.kind}")
        m.annotate(step, f"memory: plan {planned} bytes per rank")
        m.annotate(
            step,
            f"data: {self.t.data.name} ({self.t.data.kind}), "
            f"{self.loader.items_per_microbatch} items per microbatch",
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
        for name, value in extras["diagnostics"].items():
            w(step, f"diag/{name}", value)
        self.last["loss"], self.per_s = loss, per_s
        self.peak = max(self.peak, extras["peak"])
        now = time.monotonic()
        if step == self.s.steps or now - getattr(self, "_status_at", 0.0) >= _STATUS_EVERY_S:
            self._status_at = now
            self.t._status(
                self.metrics,
                step=step,
                loss=loss,
                tokens_per_s=per_s,
                eta_s=_eta(times, self.s.steps - step),
                state="running",
            )

    def _evaluate(self, step: int) -> None:
        losses, right, total = [], 0, 0
        for batch in self.loader.eval_batches(self.s.eval_batches):
            loss, output = self.program.eval_step(self.params, batch)
            losses.append(float(loss))
            target = self._target(batch, np.asarray(output))
            if target is not None:
                right += int(np.sum(np.argmax(output, axis=-1) == target))
                total += target.size
        self.last["eval_loss"], self.last["eval_step"] = float(np.mean(losses)), step
        self.metrics.write(step, "eval/loss", self.last["eval_loss"])
        if total:
            self.last["eval_accuracy"] = right / total
            self.metrics.write(step, "eval/accuracy", self.last["eval_accuracy"])

    def _target(self, batch: Mapping[str, np.ndarray], output: np.ndarray) -> np.ndarray | None:
        if output.dtype.kind != "f" or output.ndim < 2:
            return None
        for name, value in batch.items():
            if (
                name not in self.t.model_inputs
                and value.dtype.kind in "iu"
                and value.shape == output.shape[:-1]
            ):
                return value
        return None

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
        )

    def _finish(self, times: list[float]) -> None:
        planned = int(getattr(self.program, "planned_peak_bytes", 0))
        peak = self.peak
        if planned and peak:
            over = 100 * (peak - planned) / planned
            self.metrics.annotate(
                self.s.steps, f"memory: peak {peak} of {planned} planned ({over:+.0f}%)"
            )
        self.t._status(
            self.metrics,
            step=max(self.start, self.s.steps),
            loss=self.last["loss"],
            tokens_per_s=self.per_s,
            eta_s=0.0,
            state="done",
        )

    # -- checkpoints (every rank takes part) ---------------------------------------------

    def _checkpoint(self, step: int) -> None:
        mine = {"loader": self.loader.state(), "digest": _digest(self.params)}
        everyone = self.ctx.gather(mine, root=0)
        if not self.lead or self.t.location is None:
            return
        digests = {x["digest"] for x in everyone}
        if len(digests) > 1:
            raise SexpgpuError(
                "E-DP-004",
                f"the ranks' parameters differ at step {step}; checkpoint not written",
                str(self.t.location),
                hint="a device computed differently; rerun with SEXPGPU_DEBUG=1 and report it",
            )
        state = {
            "format": 1,
            "experiment_hash": self.t.hash,
            "optimizer": self.optimizer.scalars(),
            "loaders": [x["loader"] for x in everyone],
            "rng": self.rng.bit_generator.state,
            "devices": self.ctx.size,
            "nodes": 1,
            "device": self.ctx.device.kind,
        }
        ckpt = Checkpoint(step, self.params, self.optimizer.tensors(), state)
        where = save_checkpoint(self.t.location, ckpt)
        self.metrics.annotate(step, f"checkpoint: {where}")


def _eta(times: list[float], remaining: int) -> float | None:
    recent = times[-20:]
    return sum(recent) / len(recent) * remaining if recent else None
