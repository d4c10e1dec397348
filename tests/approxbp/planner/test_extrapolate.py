"""Identical blocks measured once: a model of L alike blocks planned from its 2- and 3-block
models equals the whole measurement, byte for byte; blocks that differ are measured whole."""

import pytest

from approxbp.planner import plan_step as PS
from approxbp.planner.extrapolate import layer_count, small_assignment
from approxbp.planner.request import Request

pytest.importorskip("transformers")
LLAMA = "llama:hidden=64,layers=6,heads=4,intermediate=128,vocab=100"
GPT2 = "gpt2:n_embd=64,n_layer=5,n_head=4,vocab_size=100,n_positions=64"
VIT = "vit:hidden=64,layers=5,heads=4,intermediate=128,image=32,patch=8"


def _same(a, b, extrapolated=True):
    assert a.blocks_measured == ((2, 3) if extrapolated else ()) and b.blocks_measured == ()
    assert a.saved == b.saved and a.kinds == b.kinds and a.layers == b.layers
    assert (a.parameters, a.gradients, a.optimizer, a.moment) == (b.parameters, b.gradients, b.optimizer, b.moment)


@pytest.mark.parametrize("spec, mode", [(LLAMA, "bf16"), (LLAMA, "lora"), (GPT2, "autocast"), (VIT, "lora")])
def test_extrapolated_steps_equal_whole_ones(spec, mode):
    fast, whole = PS.stepper(Request(model=spec, setup=mode)), PS.stepper(Request(model=spec, setup=mode), whole=True)
    base = whole(2, 16)
    step = fast(2, 16)
    assert step.blocks_measured == (2, 3) and step.peak == base.peak > 0
    _same(step, base)
    every = {p: "invact" for p in base.layers}
    _same(fast(2, 16, every, True), whole(2, 16, every, True))


@pytest.mark.slow  # traced steps and compiled graphs: about a minute
@pytest.mark.parametrize("kwargs", [dict(mode="compile"), dict(mode="lora", traced=True),
                                    dict(mode="bf16", checkpoint=True)])
def test_extrapolated_traced_and_compiled_steps_equal_whole_ones(kwargs):
    mode = kwargs.pop("mode")
    request = Request(model=LLAMA, setup=mode, **kwargs)
    fast, whole = PS.stepper(request), PS.stepper(request, whole=True)
    # the layers' paths, from an eager step where the mode compiles (the same modules; a whole compile fewer)
    names = PS.stepper(Request(model=LLAMA, setup="bf16"), whole=True) if mode == "compile" else whole
    every = {p: "relu-sum-k2" for p in names(2, 16).layers}
    _same(fast(2, 16, every, True), whole(2, 16, every, True))


def test_blocks_treated_differently_are_measured_whole():
    fast, whole = PS.stepper(Request(model=LLAMA, setup="bf16")), PS.stepper(Request(model=LLAMA, setup="bf16"),
                                                                             whole=True)
    layers = sorted(whole(2, 16).layers)
    mixed = {p: "invact" if i % 2 else "exact" for i, p in enumerate(layers)}
    assert small_assignment(mixed, "model.layers.", 6) is None
    _same(fast(2, 16, mixed, False), whole(2, 16, mixed, False), extrapolated=False)


def test_configs_with_layers_of_several_kinds_are_not_extrapolated():
    import transformers

    alike = transformers.AutoConfig.for_model("llama", num_hidden_layers=6)
    mixed = transformers.AutoConfig.for_model("qwen2", num_hidden_layers=4, use_sliding_window=True,
                                              max_window_layers=2, layer_types=["full_attention"] * 2
                                              + ["sliding_attention"] * 2)
    assert layer_count(alike) == ("num_hidden_layers", 6) and layer_count(mixed) is None
