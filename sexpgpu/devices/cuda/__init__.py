"""The cuda device: IR graphs lowered to PyTorch, the training step fused.

`lowering` maps every IR op to a torch call, `attention` holds the fused
scaled-dot-product kernels, and `executor.TorchGraph` plans and runs one
graph op by op on a ``torch.device``. `fused.FusedGraph` traces that
lowering and compiles it with Inductor (a CUDA graph on a GPU; large steps
in parts by `parallel_compile`'s worker processes), `stacking`
chooses how many microbatches one call runs, `step_graphs.TorchGraphs` is a
rank's graphs and `device.CudaDevice` plans, reports and loads. The same
code runs on PyTorch's CPU device, which is how CI checks it against the
interpreter without a GPU.

Importing this package does not import torch; the device imports the
submodules lazily when a cuda run starts.
"""
