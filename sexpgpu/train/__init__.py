"""Training runs: data, optimizers, schedules, the run loop, checkpoints, metrics."""
