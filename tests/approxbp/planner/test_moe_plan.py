"""approxbp plan on MoE models (Mixtral, Qwen3-MoE, OLMoE): the experts' rewrite is proven on real random twins
of their fake modules, the step on fake tensors saves byte for byte what the real one saves, and set-ups a GPU
cannot run (grouped_mm on float32 weights) or configs transformers would build wrong are refused by name."""

import pytest

pytest.importorskip("transformers")

from approxbp.cli import main  # noqa: E402
from approxbp.planner import plan as P  # noqa: E402
from approxbp.planner.request import Request  # noqa: E402

TINY = "hidden=64,layers=2,heads=4,kv_heads=2,intermediate=128,vocab=256"
MOE = [f"mixtral:{TINY}", f"qwen3_moe:{TINY},moe_intermediate_size=64", f"olmoe:{TINY}"]


@pytest.mark.parametrize("model", [MOE[0], *(pytest.param(m, marks=pytest.mark.slow) for m in MOE[1:])],
                         ids=lambda m: m.partition(":")[0])  # the quick run plans mixtral, CI all three
def test_moe_plans_on_fake_tensors_what_real_ones_save(model):
    fake = P.plan(Request(model=model, batch=2, seq=16, setup="bf16"))
    real = P.plan(Request(model=model, batch=2, seq=16, setup="bf16", fake=False))
    assert fake.before == real.before and fake.after == real.after
    assert fake.options == real.options and fake.layers == real.layers
    glu = next(iter(fake.options.values()))["glu"]
    assert glu.saving_per_layer > 0 and glu.error == 0  # the experts' exact gate saves act(g)
    assert fake.before.activations > fake.after.activations > 0


@pytest.mark.slow
def test_grouped_mm_on_float32_weights_is_refused_by_name(capsys):
    """Under autocast the weights stay float32; a GPU's grouped_mm takes bf16 only (its fake kernel raised a bare
    "Expected inputs of BF16 type" before). batched_mm, the way out the message names, plans."""
    assert main(["plan", MOE[1], "--seq", "8", "--mode", "autocast", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "grouped_mm on float32 weights" in err and "experts_implementation=batched_mm" in err
    assert main(["plan", MOE[1] + ",experts_implementation=batched_mm", "--seq", "8", "--mode", "autocast",
                 "--no-progress"]) == 0


def test_heads_that_key_value_heads_do_not_divide_are_refused(capsys):
    """Mixtral's default num_key_value_heads is 8: heads=4 alone built a model whose attention fails with a bare
    shape error."""
    assert main(["plan", "mixtral:hidden=64,layers=2,heads=4,intermediate=128,vocab=256", "--no-progress"]) == 2
    assert "num_attention_heads (4) is not a multiple of num_key_value_heads (8)" in capsys.readouterr().err
