"""approxbp/planner/report.py: the report writes block ranges once; the figure keeps one colour per category and
says when nothing was replaced."""

import pytest

pytest.importorskip("transformers")

from approxbp.planner import plan as P  # noqa: E402
from approxbp.planner import report as PR  # noqa: E402
from approxbp.planner import step_memory as SM  # noqa: E402
from approxbp.planner.report import _ranges  # noqa: E402
from approxbp.planner.request import Request  # noqa: E402

LLAMA = "llama:hidden=64,layers=2,heads=4,intermediate=128,vocab=100"


def test_block_ranges_are_written_once():
    """Runs of consecutive block indices written once; a top-level module (no dot) was printed as ".lm_head"."""
    paths = [f"model.layers.{i}" for i in (0, 1, 2, 5, 7, 8)] + ["lm_head"]
    assert _ranges(paths) == "model.layers.0–2, model.layers.5, model.layers.7–8, lm_head"


def test_the_figure_keeps_one_colour_per_category_and_draws_the_budget(tmp_path):
    """Every category the planner reports has its own fixed colour; with a budget the exact step already fits, the
    figure says that nothing was replaced (the two bars are then the same on purpose)."""
    from approxbp.kernels.ops.modules import drop_in_classes
    from approxbp.kernels.rewrite.patch import ACTIVATION_CLASSES

    ours = {c.__name__ for c in drop_in_classes()}
    kinds = (*ACTIVATION_CLASSES, *ours, "LayerNorm", "Linear", "LlamaAttention", "LlamaMLP", "x")
    names = {SM._category(k, ours) for k in kinds}
    assert names | set(PR.CATEGORIES) | {SM.AT_PEAK} <= set(PR.COLOURS)
    assert len(set(PR.COLOURS.values())) == len(PR.COLOURS)
    plan = P.plan(Request(model=LLAMA, batch=2, seq=16, setup="bf16"), budget=1 << 40)
    assert plan.after.peak == plan.before.peak
    assert PR.figure(plan, tmp_path / "f.png").stat().st_size > 10_000
