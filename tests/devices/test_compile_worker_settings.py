"""A compile worker takes every process-wide setting that Inductor's cache key reads.

A worker whose key differs compiles parts the parent cannot load: the
parent compiles them again (measured on an H200 with determinism on: 0 of 5
parts loaded, 12 s more before the first step).
"""

from __future__ import annotations

import torch

from sexpgpu.devices.cuda.compile_worker import apply_settings, settings


def _key() -> tuple:
    # What Inductor's FX graph cache key reads from the process
    # (torch._inductor.codecache.FxGraphHashDetails.deterministic_algorithms_settings).
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )


def test_the_deterministic_mode_and_its_fill_travel_to_the_worker():
    was = settings()
    try:
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = False  # as the cuda device sets
        parent, key = settings(), _key()
        apply_settings(was)  # a fresh worker: the defaults
        assert _key() != key
        apply_settings(parent)
        assert _key() == key
    finally:
        apply_settings(was)
