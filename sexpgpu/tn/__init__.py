"""Tensor-network compression by successive randomized compression (SRC).

``from sexpgpu.tn import src, apply, compress, Resources``: contract stacks of
MPOs and MPSs given as lists of per-site NumPy arrays (quimb's layout) and
compress the product in one sweep (Camaño, Epperly and Tropp,
arXiv:2504.06475). See ``docs/tn.md``.
"""

import logging

from .api import apply, compress, src
from .network import compress_network
from .resources import Resources

# Silent unless the application configures logging.
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = ["Resources", "apply", "compress", "compress_network", "src"]
