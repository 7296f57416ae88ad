"""Shared test helpers in this folder (such as ``lisp_cases``) import by name from any area."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

# Without a GPU, the Triton kernels sexpgpu writes itself run under Triton's
# interpreter (on CPU tensors); it must be set before Triton is first imported.
# Inductor's own kernels on the CPU are C++, so nothing else is interpreted.
import torch  # noqa: E402

if not torch.cuda.is_available():
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")
