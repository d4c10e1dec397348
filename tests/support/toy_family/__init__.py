"""A toy table family, ``toy-step``, added to approxbp the way another package adds one (issue 70): one module per
layer, each registering its part in that layer's registry when imported, and named as an entry point (one group per
registry, :class:`approxbp.approximations.families.Registry`), so each layer imports only its own part:

    table.py    approxbp.tables    the typed table and its checks (h̃′ = a for x < 0, b for x ≥ 0 on [A, B])
    fit.py      approxbp.certify   the fit (the least-squares levels in closed form) and its rigorous certificate
    cli.py      approxbp.fit       ``approxbp fit toy-step``
    codegen.py  approxbp.codegen   its generated Triton module (forward, backward, the PyTorch twin)
    op.py       approxbp.kernels   its spec, custom op and drop-in module (planner option ``toy-step``)
    cost.py     approxbp.cost      its kernels' launches, for ``approxbp cost``

Nothing else in approxbp names it: ``tests/approximations/test_families.py`` installs these entry points (a
``.dist-info`` folder on ``sys.path``) and takes a table from fit to a planned, costed training step.
"""

ENTRY_POINTS = {"approxbp.tables": "table", "approxbp.certify": "fit", "approxbp.fit": "cli",
                "approxbp.codegen": "codegen", "approxbp.kernels": "op", "approxbp.cost": "cost"}
