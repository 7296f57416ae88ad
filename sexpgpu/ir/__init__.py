"""The IR: graph, op registry, tracing, autodiff, passes."""
