"""The cuda device: IR graphs lowered op by op to PyTorch.

`lowering` maps every IR op to a torch call, `attention` holds the fused
scaled-dot-product kernels, and `executor.TorchGraph` plans and runs one
graph on a ``torch.device``. The same code runs on PyTorch's CPU device,
which is how CI checks it against the interpreter without a GPU.

Importing this package does not import torch; the device imports the
submodules lazily when a cuda run starts.
"""
