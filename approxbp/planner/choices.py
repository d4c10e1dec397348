"""The planner's command-line choices as plain tuples, so that building ``approxbp plan``'s parser imports no torch
(the GPUs' and tasks' names come from ``gpus`` and ``tasks``, which import none).
Each owner keeps its own (``training.WEIGHTS``, ``plan.MAXIMIZE``, …); ``tests/approxbp/test_cli.py`` holds every
tuple here equal to its owner's."""

__all__ = ["ADAPTERS", "AUTOCAST", "MAXIMIZE", "NORMS", "OPTIMIZERS", "OWNERS", "PRESETS", "TRAIN", "WEIGHTS"]

MAXIMIZE = ("batch", "seq_len")  # approxbp.planner.plan
ADAPTERS = ("auto", "fp32", "bf16", "fp16")  # approxbp.planner.training
AUTOCAST = ("off", "bf16", "fp16")
NORMS = ("auto", "fp32")
OPTIMIZERS = ("adamw", "adamw-8bit", "paged-adamw", "sgd")
PRESETS = ("bf16", "autocast", "lora", "compile")  # approxbp.planner.training.PRESETS (its keys)
TRAIN = ("full", "lora", "lora-fa", "none")
WEIGHTS = ("fp32", "bf16", "fp16", "nf4")

#: name → (owner module, attribute): what the test compares
OWNERS = {"MAXIMIZE": ("approxbp.planner.plan", "MAXIMIZE"),
          **{n: ("approxbp.planner.training", n)
             for n in ("ADAPTERS", "AUTOCAST", "NORMS", "OPTIMIZERS", "PRESETS", "TRAIN", "WEIGHTS")}}
