"""approxbp: fitted derivative approximations and generated Triton kernels for memory-saving backward passes.

The layers are subpackages: ``approxbp.approximations`` (the mathematics and the tables), ``approxbp.fitting``
(fits, reproduction, the CLI), ``approxbp.kernels`` (generated Triton kernels, custom ops and drop-ins) and
``approxbp.data`` (the packaged coefficient tables). ``python -m approxbp`` runs the CLI.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("approxbp")
except PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0+unknown"
