"""The mathematics: activations as sympy expressions and the approximant families built on them.

Imports neither ``fitting`` nor ``kernels``. The names below are imported when first asked for, so that the sympy-free
modules (``tables``, ``backends``, ``bdia``) serve the kernels' run time without importing sympy.
"""

import importlib

_EXPORTS = {"REGISTRY": "activations", "Activation": "activations", "get_activation": "activations",
            "list_activations": "activations", "x": "activations", "MAX_BITS": "relu_sum", "ReLUSum": "relu_sum",
            "check_bits": "relu_sum", "SCHEMA": "tables", "TableError": "tables"}

__all__ = list(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'approxbp.approximations' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_EXPORTS])
