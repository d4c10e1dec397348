"""Versioned coefficient tables (``coefficients/<family>/<name>.json``, schema ``approxbp.table/1``).

Read them with :func:`approxbp.approximations.tables.load`; never edit them by hand.
"""
