"""The run time: one module per family (``relu_sum``, ``invact``, ``norms``, ``glu``: spec, custom ops, eager autograd
Function, ``nn.Module`` drop-in), what their entry points share (``custom_ops``, ``guards``, ``launch``), the saved-code
layout (``packing``), the spec registry and generated-module loading (``modules``), BDIA stacks (``bdia``), the exact
baseline kernels (``reference``) and the saved-bytes meter (``saved``). Imports ``generated`` below it, never the model
rewriting (``rewrite``) or the build side (``codegen``) above it."""

__all__ = []

