"""The process-wide settings of the cuda device, made once when it opens.

PyTorch keeps its numerics switches per process, not per call, so the
device sets them once (`open_settings`) rather than every graph on every
call:

- f32 products keep full precision: no TF32 (which would round f32
  operands to 10 mantissa bits). bf16 products keep PyTorch's default,
  which lets cuBLAS sum split-K partial products in bf16: forbidding it
  (measured on an H200) sends every bf16 GEMM of GPT-2 small to
  Turing-era kernels at about half the speed.
- **Determinism** (``SEXPGPU_DETERMINISTIC``, default `BY_DEFAULT`): the
  same file, seed and GPU give the same bits, and a resume the
  uninterrupted run's. Each source of run-to-run variation is replaced:

  =====================================  ======================================
  source                                 deterministic equivalent
  =====================================  ======================================
  embedding gradients (``index_add_``'s  ``sexpgpu::scatter_rows``: ids sorted
  atomics)                               stably, each id's rows summed in the
                                         order they came, by one program
                                         (`sexpgpu.devices.cuda.scatter_rows`)
  attention backward (cuDNN's, flash's   flash attention's deterministic
  atomic dq sums)                        backward; cuDNN's is not used
  Inductor's reductions and padding      one configuration per kernel, chosen
  chosen by timing them                  without timing (``deterministic``)
  split-K products                       cuBLAS with a fixed workspace
                                         (``CUBLAS_WORKSPACE_CONFIG``); the
                                         cuBLASLt epilogues never sum in place
  the stacking degree measured at the    the cost model's pick, never measured
  first step (or remembered)             nor remembered
  an Inductor kernel loading back what   a barrier before the load, in both
  it stored (a race of its threads)      modes (`readback_barrier`)
  =====================================  ======================================

The allocator grows its segments in place (``expandable_segments``)
unless ``PYTORCH_CUDA_ALLOC_CONF`` is set, so that a plan made to the last
GiB is not lost to blocks of the wrong size.

Compile workers take the same settings from the parent
(`sexpgpu.devices.cuda.compile_worker.settings`), so Inductor's cache keys
agree.
"""

from __future__ import annotations

import os
import threading

import torch

__all__ = ["BY_DEFAULT", "deterministic", "inductor_options", "open_settings"]

# Whether runs are deterministic unless SEXPGPU_DETERMINISTIC says: off, since the mode
# costs 14% of GPT-2 small's step at batch 16 on an H200 (benches/gpu_trust.sh bench,
# benches/README.md), above the 5% that would turn it on.
BY_DEFAULT = False


def open_settings(determinism: bool) -> None:
    """Set the process's numerics switches for the cuda device (see the module docstring)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    _segments_that_grow()
    _start_context()  # after the allocator's settings, before the imports below
    if determinism:
        # cuBLAS refuses deterministic mode without a fixed workspace; this is the
        # size PyTorch gives it on Hopper anyway (the memory plan counts it).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        # Our allocations are always written before they are read: no NaN fill.
        torch.utils.deterministic.fill_uninitialized_memory = False
    else:
        torch.use_deterministic_algorithms(False)


def _segments_that_grow() -> None:
    """The allocator's segments grow in place (``expandable_segments``), unless the user says.

    A plan made to the last GiB otherwise fails on memory freed in blocks
    the next call cannot reuse: measured on a 40 GiB budget, the first
    failure left 1.2 GiB reserved but unallocated. torchtitan sets the same.
    ``PYTORCH_CUDA_ALLOC_CONF``, where set, is left as it is.
    """
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ or not torch.cuda.is_available():
        return
    # PyTorch 2.11 moved the setter (the old name warns); older ones have the old alone.
    settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or getattr(
        torch.cuda.memory, "_set_allocator_settings", None
    )
    if settings is not None:
        settings("expandable_segments:True")


def _start_context() -> None:
    """Start CUDA and the first GPU's context on a thread, beside the work that follows.

    CUDA's start (the driver, the primary context) runs in C without
    Python's lock, so the imports the switches below make (Dynamo and
    Inductor) and the front end go on meanwhile. PyTorch guards its lazy
    start with a lock: a first use on the main thread waits for it, and an
    error it met is met there again and reported (this thread drops it).
    The thread is not a daemon: a run that stops early (a file refused)
    exits once CUDA's start is done, never in the middle of it.
    """
    if not torch.cuda.is_available() or torch.cuda.is_initialized():
        return

    def start() -> None:
        try:
            torch.cuda.init()
            torch.cuda.mem_get_info(0)  # makes the context; allocates nothing
        except Exception:  # the main thread's first use meets it again and reports it
            return

    threading.Thread(target=start, name="sexpgpu-cuda-start").start()


def deterministic() -> bool:
    """Whether this process runs the cuda device deterministically (`open_settings`)."""
    return torch.are_deterministic_algorithms_enabled()


def inductor_options() -> dict[str, bool]:
    """Inductor's options for the mode: no timing that can change numerics when deterministic."""
    known = hasattr(torch._inductor.config, "deterministic")
    return {"deterministic": True} if known and deterministic() else {}
