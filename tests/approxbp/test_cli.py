import json
import os
import subprocess
import sys

import pytest
from approxbp.approximations import table_schema as TS
from approxbp.approximations import tables as table_files
from approxbp.approximations.files import check_writable

from approxbp.cli import main
from approxbp.planner import models as MD


def test_fit_writes_a_valid_table(tmp_path, capsys):
    out = tmp_path / "t.json"
    rc = main(["fit", "relu-sum", "--activation", "quick_gelu", "--bits", "2", "--restarts", "2", "--workers", "1",
               "--seed", "3", "--no-progress", "--out", str(out)])
    assert rc == 0
    t = json.loads(out.read_text())
    assert t["activation"] == "quick_gelu" and t["bits"] == 2 and t["provenance"]["seed"] == 3
    assert "--seed 3" in t["provenance"]["command"]
    assert "certificate" in capsys.readouterr().out


def test_bad_input_exits_2_with_message(capsys):
    assert main(["fit", "relu-sum", "--activation", "tanh", "--bits", "2", "--no-progress"]) == 2
    assert "cannot be approximated by a sum of ReLUs" in capsys.readouterr().err


def test_tables_lists_and_validates(capsys):
    assert main(["tables", "--family", "relu-sum"]) == 0
    assert "all valid" in capsys.readouterr().out




@pytest.mark.parametrize("argv, msg", [
    (["bdia", "analyze", "--blocks", "0"], "outside 2…1000000"),
    (["bdia", "analyze", "--level", "99999"], "outside -60…60"),
    (["bdia", "train-toy", "--steps", "0"], "outside 1…10000000"),
    (["fit", "relu-sum", "--activation", "x*1e309", "--bits", "2"], "overflows float64"),
    (["fit", "relu-sum", "--activation", "x*" + "7" * 400, "--bits", "2"], "outside float64's range"),
])
def test_bad_arguments_are_one_line_errors(argv, msg, capsys):
    try:
        rc = main(argv)
    except SystemExit as exit_:  # argparse
        rc = exit_.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and msg in err[-1] and not any("Traceback" in line for line in err)


def test_tables_reports_a_deep_json_file_and_checks_the_files_after_it(tmp_path, capsys):

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 5000 + "]" * 5000)
    assert main(["tables", str(deep), str(table_files.resolve("gelu-k2-primitive", "relu-sum"))]) == 2
    out = capsys.readouterr().out
    assert "nested too deeply" in out and "gelu-k2-primitive" in out and "1 invalid" in out


# ---- moved from test_trust.py (untrusted input, atomic writes, numerics: no silent wrong answers) ----


def test_cli_out_is_checked_before_the_fit(tmp_path):
    existing = tmp_path / "t.json"
    existing.write_text("{}")
    cases = [([str(existing)], "exists; pass --force"), ([str(tmp_path)], "is a folder")]
    if os.geteuid() != 0:  # root may write anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        cases.append(([str(ro / "t.json")], "cannot write"))
    for out, msg in cases:
        r = subprocess.run([sys.executable, "-m", "approxbp.cli", "fit", "relu-sum", "--activation", "gelu",
                            "--bits", "8", "--restarts", "64", "--out", *out], capture_output=True, text=True,
                           timeout=60)  # a k=8, 64-restart fit takes minutes: the refusal must come first
        assert r.returncode == 2 and msg in r.stderr, (out, r.stderr)
    with pytest.raises(PermissionError):
        check_writable("/proc/no/such/folder/t.json")


def test_the_verdicts_live_in_reproduce_and_fail_loudly():
    """The rules that decide a row (reproduce.py), apart from the CLI that prints them."""
    from types import SimpleNamespace

    from approxbp.papers.reproduce import bdia_verdict, invact_verdicts, verdict

    def table(left, right):
        return SimpleNamespace(metrics={"linf_left": left, "linf_right": right})

    rows = {"gelu": [table(1e-3, 1e-3), table(5e-4, 2e-3), table(4e-5, 2e-4)]}  # ours: 12.5× and 5× the best
    assert invact_verdicts(rows) == [("InvAct gelu left", True), ("InvAct gelu right", False)]
    assert bdia_verdict({"quantised": 0.0, "plain": 3.0}) == ("BDIA", True)
    assert bdia_verdict({"quantised": 1e-9, "plain": 3.0}) == ("BDIA", False)
    assert verdict([("a", True), ("b", "within")]) == (
        True, "all 2 rows within the papers' targets (each matches or beats its paper)")
    assert verdict([("a", True), ("b", False)]) == (
        False, "1 of 2 rows within the papers' targets, 0 outside with a measured cause, 1 outside unexplained; "
               "FAILED (unexplained): b")
    ok, line = verdict([("a", True), ("b", "explained"), ("c", "explained")])
    assert ok and line == ("1 of 3 rows within the papers' targets, 2 outside with a measured cause, "
                           "0 outside unexplained")
    assert "match" not in line  # an explained row is outside its target, never a match
    with pytest.raises(ValueError, match="row status 'ok'"):
        verdict([("a", "ok")])


LLAMA_TINY = "llama:hidden=64,layers=2,heads=4,intermediate=128,vocab=100"


@pytest.mark.parametrize("argv, says", [
    (["plan", LLAMA_TINY.replace("hidden=64", "hidden=63")], "transformers refused this config"),
    (["plan", "module:os:getcwd"], "must return an nn.Module"),
    (["plan", "module:nosuch.module:f"], "cannot import nosuch.module"),
    (["plan", "module:os:nope"], "os has no nope"),
    (["plan", "module:os"], "expected module:package.module:factory"),
    (["plan", "llama:hiden=64"], "hiden: the LlamaConfig has no field 'hiden' (did you mean 'hidden'?)"),
    (["plan", "openai/clip-vit-large-patch14:vision_config.hiden_act=gelu"], "CLIPVisionConfig has no field"),
])
def test_bad_models_are_refused_in_one_line(argv, says, capsys):
    """Each of these printed a traceback."""
    assert main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_known_keys_that_transformers_consumes_are_taken():
    """rope_theta (read into rope_parameters) and attn_implementation (kept privately) are not config fields but
    do something: they are not refused as unknown."""

    model, _ = MD.model_spec(LLAMA_TINY + ",rope_theta=1000,attn_implementation=eager")()
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("model, head, lora", [
    ("bert:hidden=64,layers=2,heads=4,intermediate=128,vocab=100",
     "head masked-lm (natural for an encoder: the config names no architectures)", "LoRA on query/value"),
    (LLAMA_TINY, "head causal-lm (natural for a decoder: the config names no architectures)", "LoRA on q_proj/v_proj"),
])
def test_the_plan_header_names_the_head_and_the_modules_lora_adapted(model, head, lora, capsys):
    """A config without architectures gets its family's natural head (an encoder was planned as BertLMHeadModel, a
    causal LM), and the header names the Linears LoRA matched, not the list of candidate names."""
    assert main(["plan", model, "--seq", "16", "--mode", "lora", "--use", "exact", "--no-progress"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert head in header and lora in header and "c_attn" not in header, header


def test_a_bare_config_string_is_taken_as_text():
    """hidden_act=relu said 'Expecting value: line 1 column 1' without naming the key."""

    model, _ = MD.model_spec(LLAMA_TINY + ",hidden_act=relu")()
    assert model.config.hidden_act == "relu"


@pytest.mark.slow
def test_maximize_under_an_unbounded_budget_says_so(capsys, monkeypatch):
    """--budget 1e30 --maximize batch doubled the batch until a fake tensor's size overflowed. The probes stop at
    the planner's largest size, here lowered from 2^20 to 2^8 (3 traced steps: the line through the first two
    points past it)."""
    from approxbp.planner import plan as planner

    monkeypatch.setattr(planner, "_MAX_PROBE", 1 << 8)
    assert main(["plan", LLAMA_TINY, "--seq", "16", "--budget", "1e30", "--maximize", "batch", "--no-progress"]) == 2
    assert "bounds nothing" in (err := capsys.readouterr().err) and "sizes up to 256" in err, err


def test_ctrl_c_ends_a_command_in_one_line(monkeypatch, capsys):
    """Ctrl-C during `fit` printed a KeyboardInterrupt traceback."""
    import approxbp.cli as cli

    def interrupted(args, argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.COMMANDS["fit"], "run", interrupted)
    assert main(["fit", "relu-sum", "--activation", "gelu", "--bits", "2"]) == 130
    assert capsys.readouterr().err.strip() == "approxbp: interrupted (files are written whole or not at all)"


def test_fit_invact_takes_no_progress_as_fit_relu_sum_does():
    from approxbp.cli import build_parser

    for family in ("relu-sum --bits 2", "invact"):
        args = build_parser().parse_args(["fit", *family.split(), "--activation", "gelu", "--no-progress"])
        assert args.no_progress


def test_a_huge_table_is_refused_unread(tmp_path):
    """A table with 200 000 extra coefficients took over 120 s to load."""
    from _helpers import table_json, write_json

    t = table_json("invact/gelu-fast")
    t["right"]["coefficients"] |= {f"c{i}": 1.0 for i in range(200_000)}
    with pytest.raises(TS.TableError, match="at most 1048576 bytes"):
        table_files.load(write_json(tmp_path, t))
    t = table_json("invact/gelu-fast")
    t["right"]["coefficients"] |= {f"c{i}": 1.0 for i in range(300)}
    with pytest.raises(TS.TableError, match="at most 256"):
        table_files.load(write_json(tmp_path, t))


def test_the_cli_offers_every_invact_form_and_no_other():
    from approxbp.fitting.invact import FORMS

    from approxbp.cli import build_parser

    fit = build_parser("fit")._subparsers._group_actions[0].choices["fit"]
    invact = fit._subparsers._group_actions[0].choices["invact"]
    assert next(a.choices for a in invact._actions if a.dest == "form") == FORMS


def test_the_parsers_choices_are_their_owners():
    """The command line's choices are plain tuples (approxbp/commands/choices.py) equal to each owner's."""
    import importlib

    from approxbp.commands import choices
    from approxbp.planner import choices as planner_choices

    for owner in (choices, planner_choices):
        for name, (module, attr) in owner.OWNERS.items():
            assert getattr(owner, name) == tuple(getattr(importlib.import_module(module), attr)), name


def test_help_and_argument_errors_import_no_torch_scipy_or_sympy():
    """`approxbp --help` imported torch, scipy and the fitting layer (4 s idle, 390 MB) before it printed a line."""
    code = ("import sys\nfrom approxbp.cli import build_parser, main\nbuild_parser()\n"
            "try:\n    main(['plan', 'x', '--mode', 'nope'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'scipy', 'sympy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]", out


def test_certify_states_its_budget_before_it_starts(capsys):
    """The default budget is 600 s per certificate: a user learns it before waiting, not after."""
    assert main(["certify", str(table_files.data_dir() / "invact" / "softplus-exact.json"), "--budget", "30",
                 "--max-boxes", "500", "--no-progress"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("budget per certificate: 30 s or 500 boxes, whichever comes first"), first


def test_the_fit_summary_says_the_gradient_error_beside_the_packaged_baselines(capsys):
    """SiLU k = 2 with the primitive objective: its gradient error (0.29) beside the packaged k = 1's (0.26) and the
    derivative objective's (0.09), and a warning that this k is worse than k − 1 (the numbers the issue measured);
    its gradient error is computed anew, so the refit equals the packaged k = 2 primitive table's."""
    from approxbp.approximations.gradient_error import gradient_error

    assert main(["fit", "relu-sum", "--activation", "silu", "--bits", "2", "--objective", "primitive",
                 "--restarts", "2", "--workers", "1", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    packaged = {name: gradient_error(table_files.load(f"relu_sum/silu-{name}")) for name in
                ("k1-primitive", "k2-derivative", "k2-primitive")}
    assert f"= {packaged['k2-primitive']:.4g} (this table)" in out
    assert f"{packaged['k1-primitive']:.4g} packaged k=1" in out and f"{packaged['k2-derivative']:.4g} packaged " \
        "derivative" in out
    assert packaged["k2-derivative"] < packaged["k1-primitive"] < packaged["k2-primitive"]
    assert "worse than the packaged k=1's" in err and "--objective derivative" in err


def test_export_never_writes_into_an_installed_package(monkeypatch, capsys, tmp_path):
    """Outside a source checkout the packaged tables' kernels are not rewritten in place: refused, naming
    --out-dir; with it they are written there, and a user's own table's kernels go beside the table."""
    from approxbp.commands import export

    monkeypatch.setattr(export, "source_checkout", lambda: False)
    for argv in (["export"], ["export", "relu_sum/gelu-k2-derivative"]):
        assert main(argv) == 2
        assert "--out-dir DIR" in capsys.readouterr().err
    assert main(["export", "relu_sum/gelu-k2-derivative", "--out-dir", str(tmp_path / "k")]) == 0
    assert len(list((tmp_path / "k").glob("*.py"))) == 1
    mine = tmp_path / "mine.json"
    mine.write_bytes(table_files.resolve("relu_sum/gelu-k2-derivative").read_bytes())
    assert main(["export", str(mine)]) == 0
    assert len(list((tmp_path / "_generated").glob("*.py"))) == 1


def test_a_free_level_fit_whose_borders_miss_typical_inputs_warns_and_names_the_flags(capsys):
    """x + sin(x)² on FewBit's [−100, 100] puts every border near −97 (one level for |x| ≤ 8): warned, naming
    --interval and --weight; GELU's borders lie near 0 and give no warning."""
    assert main(["fit", "relu-sum", "--levels", "free", "--activation", "x + sin(x)**2", "--bits", "2",
                 "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "every border lies outside [−8, 8]" in err and "--interval" in err and "--weight normal:σ" in err
    assert main(["fit", "relu-sum", "--levels", "free", "--activation", "gelu", "--bits", "2", "--no-progress"]) == 0
    assert "every border" not in capsys.readouterr().err


def test_certify_says_a_weighted_table_is_not_certifiable(tmp_path, capsys):
    """A table fitted with --weight: its own line and the summary say no budget certifies it (exit: open)."""
    from approxbp.commands.certify import OPEN_EXIT

    out = tmp_path / "w.json"
    assert main(["fit", "relu-sum", "--activation", "silu", "--bits", "2", "--objective", "derivative", "--weight",
                 "normal:0.5", "--restarts", "2", "--workers", "1", "--no-progress", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["certify", str(out), "--budget", "5", "--no-progress"]) == OPEN_EXIT
    text = capsys.readouterr().out
    assert "not certified: fitted with --weight normal:0.5" in text
    assert "not certified (a weighted fit: no budget closes it)" in text and "may close it" not in text


@pytest.mark.slow
def test_a_plan_without_a_budget_prints_the_traced_steps_peak_first(capsys):
    """`approxbp plan` without --budget traces the whole step by default (its first number is the step's peak);
    --modelled gives the end of the forward, faster, and says so on its second line."""
    model = LLAMA_TINY
    peaks = {}
    for flag in ([], ["--modelled"]):
        assert main(["plan", model, "--seq", "16", "--mode", "lora", "--no-progress", *flag]) == 0
        lines = capsys.readouterr().out.splitlines()
        peaks[bool(flag)] = next(line for line in lines if line.strip().startswith("peak "))
        assert ("traced" in lines[0]) != bool(flag) and ("not the step's" in lines[1]) == bool(flag), lines[:3]
    assert peaks[False] != peaks[True]
