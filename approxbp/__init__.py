"""approxbp: fitted derivative approximations and generated Triton kernels for memory-saving backward passes.

Layers, imports pointing one way only (``tests/test_architecture.py``):

    approximations   the mathematics and the tables (imports neither of the others)
    fitting          fits: ReLU-sum, InvAct, symbolic regression, the error atlas (imports approximations)
    kernels          generated Triton kernels, custom ops, drop-ins, patch_model (imports approximations)
    approxbp (top)   the command line (cli, one module per subcommand in commands/) above the papers (papers/:
                     reproduce, paper_memory, appendix_b, bdia_experiments, figures) above the planner (planner/:
                     request, plan, result, report, step_memory, models, training, …); cost and blocks shared;
                     may import all three layers, and no library module imports the command line

``approxbp.data`` holds the packaged coefficient tables. ``python -m approxbp`` runs the CLI.
"""

__all__ = []

#: The one place the version is written: pyproject.toml reads it (``dynamic``), ``approxbp --version`` prints it,
#: tables record it; CHANGELOG.md's first heading names the same release (tested).
__version__ = "0.2.0.dev0"
