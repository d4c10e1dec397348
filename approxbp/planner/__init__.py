"""The memory planner (``approxbp plan``): a training step's memory measured on fake tensors, and the approximations,
recompute, offload, chunked loss and torch.compile's activation budget chosen per layer to fit a budget.

A step is described by a :class:`~.request.Request` (the model, its input size, the training set-up); :mod:`.plan`
chooses, :mod:`.result` is the plan (its JSON, read and written in one place, and applying it to a model), and the
rest measures: :mod:`.training` (the set-up), :mod:`.models` and ``configs/``, :mod:`.tasks`, :mod:`.attention`,
:mod:`.step_memory`, :mod:`.extrapolate`, :mod:`.plan_step`, and the moves beyond the approximations
(:mod:`.moves`, :mod:`.plan_moves`, :mod:`.step_time`, :mod:`.gpus`, :mod:`.knapsack`, :mod:`.chunked_loss`,
:mod:`.pareto`, :mod:`.compiled`). Imports the three layers below, never the command line."""

__all__ = []

