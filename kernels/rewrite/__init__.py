"""Model rewriting: ``patch_model`` (``patch``) and its rewrites (activations in ``activation_swap`` and
``functional_swap``, gated MLPs in ``glu_forms`` + ``glu_patch``, MoE experts in ``moe_patch``, norms in ``norm_forms``,
``norm_consumers``, ``norm_merge``, ``norm_patch``), what they share (``common``: report, undo log, proof; ``swaps``:
what a patched module stands in for). Imports the run time
(``ops``) below it, never the build side (``codegen``)."""

__all__ = []

