"""Tensor-network compression by successive randomized compression."""
