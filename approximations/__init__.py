"""The mathematics: activations as sympy expressions and the approximant families built on them.

Imports neither ``fitting`` nor ``kernels``.
"""

from .activations import REGISTRY, Activation, get_activation, list_activations, x
from .relu_sum import MAX_BITS, ReLUSum, check_bits
from .tables import SCHEMA, TableError

__all__ = [
    "REGISTRY", "Activation", "get_activation", "list_activations", "x",
    "MAX_BITS", "ReLUSum", "check_bits", "SCHEMA", "TableError",
]
