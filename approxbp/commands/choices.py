"""The command line's choices as plain tuples, so that building a parser (``approxbp --help``, an argument error)
imports no torch, scipy or sympy. Each owner keeps its own (``fitting.invact.FORMS``, ``cost.DTYPES``, …; the
planner's are in ``approxbp.planner.choices``); ``tests/approxbp/test_cli.py`` holds every tuple here equal to its
owner's."""

__all__ = ["BACKENDS", "DTYPES", "FORMS", "METHODS", "OBJECTIVES", "OWNERS"]


FORMS = ("auto", "paper", "released", "refit-l2", "refit-linf", "newton", "sr", "fast", "exact")  # fitting.invact
OBJECTIVES = ("primitive", "derivative")  # fitting.objective
METHODS = ("anneal", "sgd", "polish")  # fitting.relu_sum
BACKENDS = ("pyoperon", "pysr")  # fitting.symbolic
DTYPES = ("bf16", "fp16", "fp32", "fp64")  # approxbp.cost (its keys)

#: name → (owner module, attribute): what the test compares
OWNERS = {"FORMS": ("approxbp.fitting.invact", "FORMS"), "OBJECTIVES": ("approxbp.fitting.objective", "OBJECTIVES"),
          "METHODS": ("approxbp.fitting.relu_sum", "METHODS"), "BACKENDS": ("approxbp.fitting.symbolic", "BACKENDS"),
          "DTYPES": ("approxbp.cost", "DTYPES")}
