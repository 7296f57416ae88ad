"""What the training tests compare against: a run's series, and the MLP trained in PyTorch."""

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np


def series(run_dir: Path, name: str) -> dict[int, float]:
    """``step -> value`` of one name in a run's ``metrics.jsonl``."""
    from sexpgpu.train.metrics import read_series

    return read_series(run_dir, name)


def torch_mlp_losses(
    init: Sequence[np.ndarray], loader, lr: Callable[[int], float], steps: int
) -> list[float]:
    """Mean losses of ``tanh(x @ w1 + b1) @ w2 + b2`` trained by PyTorch AdamW.

    `init` is ``(w1, b1, w2, b2)``; the optimizer is AdamW (lr 1e-2, betas
    (0.9, 0.95), eps 1e-8, weight decay 0.1 on the weights only), the gradient
    norm is clipped to 0.5, and each step averages the loader's microbatches.
    """
    import torch

    w1, b1, w2, b2 = (torch.nn.Parameter(torch.tensor(a)) for a in init)
    opt = torch.optim.AdamW(
        [{"params": [w1, w2], "weight_decay": 0.1}, {"params": [b1, b2], "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    losses = []
    for step in range(steps):
        opt.zero_grad()
        batches = loader.next_step()
        total = 0.0
        for batch in batches:
            x, y = torch.tensor(batch["x"]), torch.tensor(batch["y"]).long()
            loss = torch.nn.functional.cross_entropy(torch.tanh(x @ w1 + b1) @ w2 + b2, y)
            (loss / len(batches)).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_([w1, b1, w2, b2], 0.5)
        for group in opt.param_groups:
            group["lr"] = lr(step)
        opt.step()
        losses.append(total / len(batches))
    return losses
