"""approxbp plan: a step's memory on fake tensors equals the same measurement on real tensors, in every mode;
the chosen plan applies through Plan.load(path).apply(model) and saves what it said; the knapsack is optimal."""

import itertools
import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("transformers")

from approxbp.planner import models as MD
from approxbp.planner import plan as P  # noqa: E402
from approxbp.planner import plan_step as PS
from approxbp.planner import report as PR
from approxbp.planner import search as S
from approxbp.planner import step_memory as SM
from approxbp.planner import training as SU
from approxbp.planner.request import Request
from approxbp.planner.result import OptionCost

LLAMA = "llama:hidden=64,layers=2,heads=4,intermediate=128,vocab=100"
GPT2 = "gpt2:n_embd=64,n_layer=2,n_head=4,vocab_size=100,n_positions=64"


@pytest.mark.parametrize("model, mode", [(LLAMA, "bf16"), pytest.param(LLAMA, "autocast", marks=pytest.mark.slow),
                                         pytest.param(LLAMA, "lora", marks=pytest.mark.slow),
                                         pytest.param(LLAMA, "compile", marks=pytest.mark.slow),
                                         pytest.param(LLAMA, "checkpoint", marks=pytest.mark.slow),
                                         pytest.param(GPT2, "bf16", marks=pytest.mark.slow),
                                         (GPT2, "lora"),
                                         pytest.param(GPT2, "lora+checkpoint", marks=pytest.mark.slow)])
def test_fake_tensors_predict_the_real_measurement_exactly(model, mode):
    mode, _, ck = mode.partition("+")
    if mode == "checkpoint":
        mode, ck = "bf16", "checkpoint"
    fake = P.plan(Request(model=model, batch=2, seq=16, setup=mode, checkpoint=bool(ck)))
    real = P.plan(Request(model=model, batch=2, seq=16, setup=mode, fake=False, checkpoint=bool(ck)))
    mode = "checkpoint" if ck else mode
    assert fake.before == real.before and fake.after == real.after
    assert fake.options == real.options and fake.ms_norm == real.ms_norm
    if mode == "compile":  # inductor recomputes the exact SwiGLU/GELU pointwise tail: a drop-in may not pay
        assert fake.before.activations >= fake.after.activations > 0
    elif mode == "checkpoint":  # at 2 × 16 tokens the peak may be AdamW's step, with no activation alive
        assert fake.before.peak >= fake.after.peak
    else:
        assert fake.before.activations > fake.after.activations > 0  # something was saved
    if mode == "checkpoint":  # a traced step: the peak's moment
        assert fake.before.peak_moment in ("the optimizer step", "the backward") or \
            fake.before.peak_moment.startswith("backward of ")
    elif mode != "compile":  # App. B units of the first block (module hooks do not fire inside a compiled graph)
        assert fake.before.block in ("model.layers.0", "transformer.h.0")
        assert fake.before.block_units > fake.after.block_units > 0
    act = next(iter(fake.options.values()))
    assert act["invact"].error < 1e-6 < act["relu-sum-k4"].error < act["relu-sum-k2"].error


@pytest.mark.slow
def test_checkpointing_keeps_block_inputs_and_one_recomputed_block():
    """A 4-layer model under activation checkpointing holds less at its traced peak than the same step without it,
    and the drop-ins save there too (they run as their custom ops: their kernels' outputs only)."""
    deep = "llama:hidden=64,layers=4,heads=4,intermediate=128,vocab=100"
    ck = PS.stepper(Request(model=deep, setup="bf16", checkpoint=True))(2, 64)
    plain = PS.stepper(Request(model=deep, setup="bf16", traced=True))(2, 64)  # the same step, not checkpointed
    assert ck.activations < 0.5 * plain.activations
    replaced = PS.stepper(Request(model=deep, setup="bf16", checkpoint=True))(2, 64,
                                                                              {p: "relu-sum-k2" for p in ck.layers})
    assert replaced.peak < ck.peak
    with pytest.raises(ValueError, match="not supported"):
        PS.stepper(Request(model=deep, setup="compile", checkpoint=True))(2, 64)


@pytest.mark.slow
def test_a_plan_applies_to_the_model_and_saves_what_it_said(tmp_path):
    budget = P.plan(Request(model=LLAMA, batch=2, seq=16, setup="bf16")).before.peak - 20_000
    chosen = P.plan(Request(model=LLAMA, batch=2, seq=16, setup="bf16"), budget=budget)
    assert chosen.after.peak <= budget
    path = tmp_path / "plan.json"
    path.write_text(chosen.to_json())
    with SU.weights_for("bf16"):
        torch.manual_seed(0)
        model, inputs = MD.model_spec(LLAMA)()
        model = SM.prepare(model, "bf16")
    x = {k: v for k, v in inputs(2, 16).items()}
    report = PR.Plan.load(path).apply(model, example_input=x)
    assert len(report.norms) == (5 if chosen.ms_norm.chosen else 0)  # the final one too: its output is shared
    assert SM.measure(model, x, "bf16").activations == chosen.after.activations


def test_the_knapsack_is_the_least_error_choice_that_fits():
    layers = {f"l{i}": "act" for i in range(4)}
    options = {"act": {"exact": OptionCost(0, 0.0), "a": OptionCost(30, 0.3), "b": OptionCost(50, 1.0),
                       "c": OptionCost(20, 0.05)}}
    for need in (0, 20, 45, 90, 130, 170, 200):
        got, ms_norm = S._choose(layers, options, 15, 1000, 1000 - need)
        assert set(got) == set(layers)  # the layers only: the MS-norms' choice is a value of its own
        saving = sum(options["act"][o].saving_per_layer for o in got.values()) + (15 if ms_norm else 0)
        error = sum(options["act"][o].error for o in got.values())
        best = min(sum(options["act"][o].error for o in combo)
                   for combo in itertools.product(options["act"], repeat=4) for ms in (0, 15)
                   if sum(options["act"][o].saving_per_layer for o in combo) + ms >= need)
        assert saving >= need and error == pytest.approx(best), (need, got)
    with pytest.raises(ValueError, match="options save at most"):
        S._choose(layers, options, 15, 1000, 700)


@pytest.mark.parametrize("text, message", [("llama:hidden", "expected key=value"), ("nope.json", "No such file"),
                                           ("llama:hidden=64,layers=x", "num_hidden_layers. expected int")])
def test_bad_model_specs_are_refused(text, message):
    with pytest.raises((ValueError, OSError), match=message):
        MD.model_spec(text)


def test_sizes_parse_and_print():
    assert SM.parse_size("24GiB") == 24 * 2**30 and SM.parse_size("512 MiB") == 2**29 and SM.parse_size("1e9") == 10**9
    assert SM.size(3 * 2**30) == "3.00 GiB" and SM.size(640) == "640 B"
    with pytest.raises(ValueError, match="expected a number"):
        SM.parse_size("12 parsecs")


@pytest.mark.slow
def test_cli_writes_the_plan_and_its_figure(tmp_path, capsys):
    """Through approxbp's main in this process (the `approxbp` start has its own test, test_cli_user)."""
    from approxbp.cli import main

    out, fig = tmp_path / "plan.json", tmp_path / "plan.png"
    code = main(["plan", LLAMA, "--batch", "2", "--seq", "16", "--mode", "lora", "--out", str(out), "--figure",
                 str(fig), "--no-progress"])
    said = capsys.readouterr()
    assert code == 0, said.err
    data = json.loads(out.read_text())
    assert data["after"]["peak"] <= data["before"]["peak"] and fig.stat().st_size > 10_000
    assert "planned" in said.out and "choice:" in said.out
    assert main(["plan", LLAMA, "--budget", "1KiB", "--no-progress"]) == 2
    assert "no assignment fits" in capsys.readouterr().err


@pytest.mark.slow
def test_compile_mode_saves_what_inductor_saves():
    """The planner and ``blocks.saved_per_token_per_d(mode="compile")`` compile with inductor's partitioner but no code
    generation (aot_eager_decomp_partition); on the GPT, ViT and LLaMA-style blocks it saves exactly what a real
    inductor compile saves (the ViT block also with frozen linears, as LoRA trains it)."""
    from approxbp.kernels.ops.saved import charged

    from approxbp.blocks import GPTBlock, LlamaBlock, ViTBlock

    for cls, d, frozen in ((GPTBlock, 128, False), (ViTBlock, 768, False), (ViTBlock, 768, True),
                           (LlamaBlock, 1024, False)):
        got = []
        for backend in ("inductor", "aot_eager_decomp_partition"):
            torch.manual_seed(0)
            with SU.weights_for("bf16"):
                block = cls()
            for p in block.parameters():
                p.requires_grad_(not frozen)
            x = torch.randn(2, 16, d, dtype=torch.bfloat16, requires_grad=True)
            torch._dynamo.reset()
            compiled = torch.compile(block, backend=backend, fullgraph=True)
            saved = {}
            with charged(saved, list(block.parameters()), block):
                compiled(x)
            got.append(sum(saved.values()))
        assert got[0] == got[1] > 0, (cls.__name__, frozen, got)


@pytest.mark.slow
def test_maximize_finds_the_largest_batch_that_fits():
    exact = P.plan(Request(model=LLAMA, batch=2, seq=16, setup="bf16"))
    per_sample = (exact.after.activations) / 2
    budget = exact.after.peak + int(3.5 * per_sample)  # room for about 3 more samples with the savings applied
    best, chosen = P.maximize(Request(model=LLAMA, batch=2, seq=16, setup="bf16"), what="batch", budget=budget)
    assert chosen.batch == best and chosen.after.peak <= budget
    step = PS.stepper(Request(model=LLAMA, setup="bf16", traced=True))  # the peak a plan promises: traced
    assignment = {p: layer.option for p, layer in P.plan(Request(model=LLAMA, batch=2, seq=16,
                                                                    setup="bf16")).layers.items()}
    assert step(best + 1, 16, assignment, True).peak > budget  # one more does not fit, even saving the most
    with pytest.raises(ValueError, match="does not fit"):
        P.maximize(Request(model=LLAMA, batch=2, seq=16, setup="bf16"), what="batch", budget=exact.before.parameters)


@pytest.mark.parametrize("name, cls", [("vit_b", "ViTBlock"), ("llama_block", "LlamaBlock"), ("gpt_block", "GPTBlock")])
def test_the_project_blocks_plan_to_the_memory_table(name, cls):
    """The planner on fake tensors, the README's per-block table on real ones (benchmarks/memory_blocks.py's
    saved_per_token_per_d, a separate code path): the same bytes per block, exact and with every layer at its
    most-saving option (trainable bf16 weights, 2 × 197 tokens; App. B units = bytes per token per d / 2)."""
    from approxbp import blocks

    block_cls = getattr(blocks, cls)
    p = P.plan(Request(model=f"module:approxbp.blocks:{name}", batch=2, seq=197, setup="bf16"))
    assert p.before.block_units == pytest.approx(blocks.saved_per_token_per_d(block_cls, "baseline", False) / 2,
                                                    abs=1e-4)
    option = next(iter(p.layers.values())).option  # saving the most: InvAct for trainable linears
    variant = {"invact": "invact", "relu-sum-k2": "relu-sum"}.get(option)
    if variant is not None and p.ms_norm.chosen:
        assert p.after.block_units == pytest.approx(blocks.saved_per_token_per_d(block_cls, variant, False) / 2,
                                                       abs=1e-4)


def test_planning_leaves_no_fake_tensor_in_shared_caches():
    """Drop-ins built during a fake-tensor plan share specs and cached constants with later real ones; a cached fake
    tensor read by a real (compiled) kernel crashed the process. Every cache holds real tensors."""
    from approxbp.kernels import ReGELU2
    from approxbp.kernels.ops.modules import SPECS
    from approxbp.kernels.ops.packing import _place_values, byte_codes
    from torch._subclasses.fake_tensor import FakeTensor

    P.plan(Request(model=GPT2, batch=1, seq=8, setup="bf16"))
    cached = [byte_codes(b, torch.device("cpu")) for b in (1, 2, 4, 8)] + [_place_values(2, torch.device("cpu"))]
    for spec in SPECS.values():
        cached += [t for t in vars(spec).values() if isinstance(t, torch.Tensor)]
        cached += [t for consts in getattr(spec, "_dev", {}).values() for t in consts]
    assert cached and not any(isinstance(t, FakeTensor) for t in cached)
    x = torch.randn(64, requires_grad=True)
    ReGELU2()(x).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_a_lora_plan_applies_to_a_real_peft_model_and_refuses_another_model(tmp_path):
    """A plan made with --mode lora was dropped whole on a real peft model (its paths start base_model.model.…,
    every choice 'not in the activation mapping'); a plan for another model was accepted; malformed plans raised
    KeyError/TypeError/AttributeError."""
    peft = pytest.importorskip("peft")
    made = P.plan(Request(model=LLAMA, batch=2, seq=16, setup="lora"))
    path = tmp_path / "plan.json"
    path.write_text(made.to_json())
    chosen = [p for p, layer in made.layers.items() if layer.table]
    fused = [p for p, layer in made.layers.items() if layer.option == "glu"]  # the exact GLU: no table
    assert chosen or fused

    def build(text=LLAMA):
        torch.manual_seed(0)
        model, inputs = MD.model_spec(text)()
        return model, inputs(2, 16)

    model, x = build()
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    report = PR.Plan.load(path).apply(model, example_input=x)
    assert len(report.activations) == len(chosen) and len(report.glus) == len(fused), report
    assert all(a.startswith("base_model.model.") for a in report.activations + report.glus)
    for other in (LLAMA.replace("layers=2", "layers=4"), "gpt2:n_embd=64,n_layer=2,n_head=4,vocab_size=100"):
        model, x = build(other)
        with pytest.raises(ValueError, match="made for another model"):
            PR.Plan.load(path).apply(model, example_input=x)
    model, x = build()  # without an example, each planned GLU says it was not applied, never "exact by choice",
    with pytest.warns(UserWarning, match="the plan and its application disagree") as said:  # and warns
        report = PR.Plan.load(path).apply(peft.get_peft_model(model, peft.LoraConfig(r=8,
                                                                                     target_modules=["q_proj"])))
    (message,) = [str(w.message) for w in said if "disagree" in str(w.message)]
    assert message.count("listed in glu=, not fused") == len(fused)
    assert not report.glus and not any("exact by choice" in s for s in report.skipped), report
    not_applied = [s for s in report.skipped if "listed in glu=, not fused" in s]
    assert len(not_applied) == len(fused), report
    model, x = build()
    for bad, field in (({}, "layers"), ({"layers": {"a": 1}}, "layers"), ({"layers": {}, "ms_norm": None}, "ms_norm"),
                       ("[1, 2", "not a readable plan"), ({"layers": {}, "ms_norm": {"chosen": False}}, "no model")):
        p = tmp_path / "bad.json"
        p.write_text(bad if isinstance(bad, str) else json.dumps(bad))
        with pytest.raises(ValueError, match=field):
            PR.Plan.load(p).apply(model)


def test_use_evaluates_a_given_assignment_on_fake_and_real_tensors(tmp_path):
    """--use measures the assignment it is given (no option tried, nothing chosen); a plan's own
    JSON evaluates to that plan's numbers, and fake tensors give the real measurement."""
    chosen = P.plan(Request(model=LLAMA, batch=2, seq=16, setup="bf16"))
    path = tmp_path / "plan.json"
    path.write_text(chosen.to_json())
    again = P.evaluate(Request(model=LLAMA, batch=2, seq=16, setup="bf16"), use=str(path))
    assert again.after == chosen.after and again.before == chosen.before and again.use == str(path)
    fake = P.evaluate(Request(model=LLAMA, batch=2, seq=16, setup="bf16"), use="relu-sum-k2+ms-norm")
    real = P.evaluate(Request(model=LLAMA, batch=2, seq=16, setup="bf16", fake=False), use="relu-sum-k2+ms-norm")
    assert fake.after == real.after and fake.ms_norm.chosen
    assert {layer.option for layer in fake.layers.values()} == {"relu-sum-k2"}
    assert fake.after.activations < fake.before.activations
    exact = P.evaluate(Request(model=LLAMA, batch=2, seq=16, setup="bf16"), use="exact")
    assert exact.after == exact.before and "the given assignment (--use exact)" in PR.report(exact)


def test_evaluating_several_assignments_at_once_gives_each_ones_plan():
    """evaluate_each measures the exact step once for all the assignments: each plan equals evaluate's alone."""
    uses = ["exact", "invact", "relu-sum-k2+ms-norm"]
    together = P.evaluate_each(Request(model=LLAMA, batch=2, seq=16, setup="bf16"), uses=uses)
    for use, plan in zip(uses, together):
        alone = P.evaluate(Request(model=LLAMA, batch=2, seq=16, setup="bf16"), use=use)
        assert (plan.use, plan.before, plan.after, plan.layers) == (alone.use, alone.before, alone.after, alone.layers)


@pytest.mark.slow  # about 40 s: two searches of fake steps
def test_maximize_with_a_given_assignment_finds_the_largest_size_that_fits():
    budget = SM.parse_size("3MiB")
    best, result = P.maximize(Request(model=LLAMA, batch=2, seq=16, setup="bf16"), what="batch", budget=budget,
                              use="exact")
    assert result.use == "exact" and result.batch == best and result.after.peak <= budget
    assert result.after.peak_traced or result.traced
    assert P.evaluate(Request(model=LLAMA, batch=best + 1, seq=16, setup="bf16", traced=True),
                      use="exact").after.peak > budget
    saving, _ = P.maximize(Request(model=LLAMA, batch=2, seq=16, setup="bf16"), what="batch", budget=budget,
                           use="invact+ms-norm")
    assert saving > best


@pytest.mark.parametrize("text, message", [("relu-sum-k9", "expected one of"), ("invact+relu-sum-k2", "expected one"),
                                           ("ms-norm+ms-norm", "expected one"), ("missing.json", "not a plan")])
def test_use_refuses_what_it_cannot_evaluate(text, message):
    with pytest.raises(ValueError, match=message):
        P.parse_use(text)


@pytest.mark.parametrize("fake", [True, False])
@pytest.mark.slow
def test_planning_leaves_the_users_random_state_alone(fake):
    """The planner seeds its model's weights; it once left torch's generator at seed 0, so a user's dropout after
    planning differed from stock's (9.2e-4 relative in a Trainer run). The stream continues as if no plan ran."""
    torch.manual_seed(1234)
    torch.rand(3)
    state = torch.get_rng_state()
    expected = torch.rand(5)
    torch.set_rng_state(state)
    P.plan(Request(model=LLAMA, batch=2, seq=16, setup="bf16", fake=fake),
           budget=P.plan(Request(model=LLAMA, batch=2, seq=16, setup="bf16")).before.peak - 20_000)
    assert torch.equal(torch.rand(5), expected)


def test_use_takes_a_users_own_table_file(tmp_path):
    """--use TABLE.json (a table the user fitted, here a packaged SiLU table copied out): every layer of its
    activation takes it, and the step is the packaged option's; a table of an activation the model lacks, and a file
    that is neither a table nor a plan, are refused by name."""
    import shutil

    from approxbp.approximations import tables as table_files

    mine = tmp_path / "my-silu.json"
    shutil.copy(table_files.resolve(PS.option_table("silu", "relu-sum-k2")), mine)
    ours = P.evaluate(Request(model=LLAMA, batch=2, seq=16, setup="bf16"), use=f"{mine}+ms-norm")
    packaged = P.evaluate(Request(model=LLAMA, batch=2, seq=16, setup="bf16"), use="relu-sum-k2+ms-norm")
    assert ours.after == packaged.after and ours.ms_norm.chosen
    assert {layer.table for layer in ours.layers.values()} == {str(mine)}
    gelu = tmp_path / "my-gelu.json"
    shutil.copy(table_files.resolve(PS.option_table("gelu", "relu-sum-k2")), gelu)
    with pytest.raises(ValueError, match="a table of 'gelu'; this model's activation layers are silu"):
        P.evaluate(Request(model=LLAMA, batch=2, seq=16, setup="bf16"), use=str(gelu))
    junk = tmp_path / "junk.json"
    junk.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="neither a table nor a plan"):
        P.evaluate(Request(model=LLAMA, batch=2, seq=16, setup="bf16"), use=str(junk))


@pytest.mark.slow
def test_an_untraced_plan_says_first_that_its_peak_is_not_the_steps():
    """The first number of `approxbp plan` without --trace/--budget is the modelled end of the forward: the report
    says so on its second line (here 1.19 MiB modelled against the traced step's 1.54 MiB, vocab 3 000); a traced
    plan does not."""
    model = "llama:hidden=64,layers=2,heads=4,intermediate=128,vocab=3000"
    modelled = P.plan(Request(model=model, batch=1, seq=16, setup="lora"))
    traced = P.plan(Request(model=model, batch=1, seq=16, setup="lora", traced=True))
    assert "not the step's" in PR.report(modelled).splitlines()[1]
    assert "not the step's" not in PR.report(traced)
    assert traced.after.peak > 1.2 * modelled.after.peak


def test_a_users_table_is_one_more_option_of_its_activation(tmp_path):
    """--table FILE (Request.tables): the search measures it beside the packaged options of its activation — here a
    copy of the packaged SiLU k = 2 table, so the same saving and gradient error as relu-sum-k2 — and a table of an
    activation the model lacks is refused by name."""
    import shutil

    from approxbp.approximations import tables as table_files

    mine = tmp_path / "my-silu.json"
    shutil.copy(table_files.resolve(PS.option_table("silu", "relu-sum-k2")), mine)
    plan = P.plan(Request(model=LLAMA, batch=2, seq=16, setup="bf16", tables=(str(mine),)))
    ours = plan.options["silu"][PS.TABLE_OPTION + str(mine)]
    assert ours == plan.options["silu"]["relu-sum-k2"]
    gelu = tmp_path / "my-gelu.json"
    shutil.copy(table_files.resolve(PS.option_table("gelu", "relu-sum-k2")), gelu)
    with pytest.raises(ValueError, match="a table of 'gelu'; this model's activation layers are silu"):
        P.plan(Request(model=LLAMA, batch=2, seq=16, setup="bf16", tables=(str(gelu),)))


def _doubling_then_bisection(fits, start: int, grain: int) -> int:
    """The search --maximize ran before the secant one: the reference its answers must equal."""
    lo, hi = 0, max(grain, start // grain * grain)
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > grain:
        mid = (lo + hi) // 2 // grain * grain
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


@given(fixed=st.integers(0, 10**10), slope=st.integers(1, 10**8), curve=st.integers(0, 10**4),
       jitter=st.integers(0, 10**3), room=st.integers(0, 10**5), start=st.sampled_from([1, 2, 16, 384, 2048]),
       grain=st.sampled_from([1, 8, 64]))
def test_the_secant_search_finds_what_bisection_finds_in_fewer_probes(fixed, slope, curve, jitter, room, start, grain):
    """A peak nondecreasing in the size (affine, convex, with steps smaller than the slope, as allocator rounding
    makes them): the same largest fitting size as doubling then bisection, never more probes plus two, and at most
    five where the peak is affine."""
    def peak(v):
        return fixed + slope * v + curve * v * v + (v * 7919 % (jitter + 1) if jitter < slope else 0)

    budget = fixed + room * slope
    bisected = [0]

    def fits(v):
        bisected[0] += 1
        return peak(v) <= budget

    want = _doubling_then_bisection(fits, start, grain)
    probed = []
    got = P._largest_fitting(lambda v: probed.append(v) or peak(v), start, grain, budget, "batch")
    assert got == want and len(probed) == len(set(probed)) and len(probed) <= bisected[0] + 2, (probed, bisected)
    if curve == 0 and (jitter == 0 or jitter >= slope):
        assert len(probed) <= 5, probed
