"""The subcommands of ``approxbp``, one module each: ``add_parser(sub, add)`` beside ``run(args, argv)``, each a thin
layer over the Python API it names."""

__all__ = []

