"""approxbp/planner/request.py: one Request describes a step (keyword-only, checked on construction), and the
command line's spelling of it is read by the planner's own parser, which the CLI and the papers' rows share."""

import dataclasses

import pytest

from approxbp.planner.request import Request, compile_budgets, parse
from approxbp.planner.training import PRESETS, Setup


def test_a_request_is_keyword_only_and_names_a_preset_or_a_setup():
    with pytest.raises(TypeError):
        Request("llama", 2, 16)  # the fields are keywords
    r = Request(model="llama", batch=2, seq=16, setup="lora")
    assert r.setup == PRESETS["lora"] and Request(model="llama").setup == PRESETS["bf16"]
    assert Request(model="llama", setup=Setup(weights="fp32")).setup.weights == "fp32"
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.batch = 3


@pytest.mark.parametrize("field, value", [("batch", 0), ("seq", -1), ("lora_r", 0), ("batch", 2.5), ("batch", True)])
def test_a_size_that_is_not_a_positive_integer_is_refused_in_one_line(field, value):
    with pytest.raises(ValueError, match=f"--{field.replace('_', '-')} must be a positive integer"):
        Request(model="llama", **{field: value})


def test_at_changes_only_the_size():
    r = Request(model="llama", batch=2, seq=16, setup="lora", lora_r=4, checkpoint=True)
    assert r.at(batch=8) == dataclasses.replace(r, batch=8) and r.at(seq=64).seq == 64 and r.at() == r


def test_the_command_line_spelling_reads_back_as_the_request():
    """What `approxbp plan` and the papers' memory rows parse: set-up options override --mode's preset."""
    args = parse(["llama", "--batch", "4", "--seq", "640", "--mode", "lora", "--weights", "nf4", "--lora-targets",
                  "q_proj, v_proj", "--lora-dropout", "0.1", "--trace", "--lora-r", "64", "--use", "relu-sum-k2"])
    r = Request.from_args(args)
    assert (r.model, r.batch, r.seq, r.lora_r, r.traced, r.checkpoint) == ("llama", 4, 640, 64, True, False)
    assert r.setup == dataclasses.replace(PRESETS["lora"], weights="nf4", lora_targets=("q_proj", "v_proj"),
                                          lora_dropout=0.1)
    assert args.use == "relu-sum-k2" and Request.from_args(parse(["llama"])) == Request(model="llama")


def test_the_cli_reads_its_plan_arguments_from_the_planner():
    """One parser: every option of `approxbp plan` but --out, --figure and --no-progress is the planner's."""
    import argparse

    from approxbp.cli import build_parser
    from approxbp.planner.request import add_arguments

    sub = build_parser()._subparsers._group_actions[0].choices["plan"]
    planner = argparse.ArgumentParser()
    add_arguments(planner)
    ours = {a.dest for a in planner._actions}
    assert {a.dest for a in sub._actions} - ours == {"out", "figure", "no_progress"}


def test_compile_budgets_are_fractions():
    assert compile_budgets("1,0.4,0") == (1.0, 0.4, 0.0) and compile_budgets(None) == ()
    with pytest.raises(ValueError, match="comma-separated fractions"):
        compile_budgets("2")
