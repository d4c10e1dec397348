"""The run time: one module per family (``relu_sum``, ``invact``, ``norms``, ``glu``: spec, one ``custom_ops.Op``
description from which its custom ops and eager autograd Function are made, ``nn.Module`` drop-in), the ops of a merged
norm's readers (``norm_linear``), what the entry points share (``custom_ops``, ``guards``, ``launch``), the saved-code
layout (``packing``), the spec registry and generated-module loading (``modules``), BDIA stacks (``bdia``), the exact
baseline kernels (``reference``) and the saved-bytes meter (``saved``). Imports ``generated`` below it, never the model
rewriting (``rewrite``) or the build side (``codegen``) above it."""

__all__ = []

