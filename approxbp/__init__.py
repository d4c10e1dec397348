"""approxbp: fitted derivative approximations and generated Triton kernels for memory-saving backward passes.

Layers, imports pointing one way only (``tests/test_architecture.py``):

    approximations   the mathematics and the tables (imports neither of the others)
    fitting          fits: ReLU-sum, InvAct, symbolic regression, the error atlas (imports approximations)
    kernels          generated Triton kernels, custom ops, drop-ins, patch_model (imports approximations)
    approxbp (top)   cli (one module per subcommand in commands/), reproduce, the planner (plan, step_memory,
                     models, plan_result), cost, blocks (benchmark models), bdia_experiments (toy BDIA-GPT,
                     analysis): may import all three

``approxbp.data`` holds the packaged coefficient tables. ``python -m approxbp`` runs the CLI.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("approxbp")
except PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0+unknown"
