"""sexpgpu: experiments as S-expressions, and tensor-network compression."""

from sexpgpu.errors import SexpgpuError

__all__ = ["SexpgpuError", "__version__"]
__version__ = "0.1.0"
