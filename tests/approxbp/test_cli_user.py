"""What a new user meets on the command line and in the Python API."""

import contextlib
import hashlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _helpers import ROOT
from _once import once_per_run
from approxbp.approximations import tables as table_files

from approxbp.cli import build_parser, main


def _run(*args, env=None, cwd=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "approxbp", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout)


def test_version_and_python_dash_m(tmp_path):
    r = _run("--version", cwd=tmp_path)
    assert r.returncode == 0 and re.fullmatch(r"approxbp \S+\n", r.stdout)


def _parsers(p):
    yield p
    for a in p._actions:
        if a.choices and isinstance(a.choices, dict):
            for sub in a.choices.values():
                yield from _parsers(sub)


def test_every_option_has_help_and_shows_its_default():
    for p in _parsers(build_parser()):
        assert p.formatter_class.__name__ == "ArgumentDefaultsHelpFormatter", p.prog
        for a in p._actions:
            if a.option_strings and a.dest not in ("help", "version"):
                assert a.help, f"{p.prog} {a.option_strings} has no help"
    text = " ".join(_run("fit", "relu-sum", "--help").stdout.split())
    assert "Default: primitive, derivative with --levels free" in text
    assert "invact" in _run("export", "--help").stdout


def test_tables_validates_user_files_and_refuses_unknown_families(tmp_path, capsys):
    good = table_files.save(table_files.load("relu_sum/gelu-k2-primitive"), tmp_path / "good.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**table_files.load("relu_sum/gelu-k2-primitive"), "bits": 3}))
    assert main(["tables", str(good)]) == 0
    assert main(["tables", str(good), str(bad)]) == 2
    out = capsys.readouterr().out
    assert "INVALID" in out and "bad.json" in out and "1 invalid" in out
    assert main(["tables", "--family", "foo"]) == 2  # refused by name at run time: another package may add a family
    assert "no table class for table family 'foo'; known: invact, relu-sum" in capsys.readouterr().err


def test_fit_prints_restart_agreement_and_progress_lines_in_a_log(tmp_path, capsys):
    assert main(["fit", "relu-sum", "--activation", "silu", "--bits", "2", "--restarts", "2", "--workers", "1"]) == 0
    r = capsys.readouterr()
    assert re.search(r"\d+ of \d+ restarts reached the best loss", r.out)
    assert re.search(r"silu k=2 primitive: \d+/\d+ \(\d+ s\)", r.err)  # not a TTY: plain lines, no bars
    assert "\r" not in r.err


def test_k8_summary_fits_one_screen(monkeypatch, capsys):
    """`approxbp fit … --bits 8` summarises its 255 ReLUs in one screen; the fit is the packaged k = 8 table's (what
    is tested is the summary, not the 30 s fit)."""
    from approxbp.fitting import relu_sum
    from approxbp.fitting.result import FitResult

    table = table_files.load("relu_sum/gelu-k8-primitive")
    done = FitResult(table=table, fun=table.loss, message="1 of 1 restarts reached the best loss", untrusted=False,
                     restarts=[table.loss])
    monkeypatch.setattr(relu_sum, "fit_relu_sum", lambda *a, **kw: done)
    assert main(["fit", "relu-sum", "--activation", "gelu", "--bits", "8", "--restarts", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "k=8" in out.splitlines()[0] and "knots" in out and "gradient" in out, out
    assert len(out.splitlines()) <= 24, out


def test_fit_invact_does_not_cut_a_token(tmp_path, capsys):
    assert main(["fit", "invact", "--activation", "gelu", "--form", "paper"]) == 0
    for line in capsys.readouterr().out.splitlines():
        if "q = " in line:
            q = line.split("q = ", 1)[1]
            paper = table_files.load("invact/gelu-paper")
            assert q.endswith(" …") or q in {paper[s]["expression"] for s in ("left", "right")}


@pytest.mark.parametrize("activation", ["silu", pytest.param("mish", marks=pytest.mark.slow), "x*sigmoid(2*x)"])
def test_symbolic_regression_runs_for_every_activation(activation):
    """t = y − f(T) rounds to −1e-17 at the turning point; that NaN used to stop pyoperon."""
    pytest.importorskip("pyoperon")
    from approxbp.fitting.invact import fit_invact
    from approxbp.fitting.symbolic import pick_form

    t = fit_invact(activation, "sr", sr_generations=2).table
    assert all(t["metrics"][f"linf_{b}"] < 1 for b in ("left", "right"))
    form = pick_form(t, "left", 0)
    assert form.latex() and str(form.substituted()) and form.torch_fn()(torch.tensor([-0.1])).isfinite().all()


def test_user_kernels_live_next_to_the_table(tmp_path):
    from approxbp.kernels import ReLUSumActivation

    table = table_files.save(table_files.load("relu_sum/silu-k3-derivative") | {"activation": "my-silu"},
                             tmp_path / "my.json")
    assert main(["export", str(table)]) == 0  # in this process: the suite runs under TRITON_INTERPRET=1
    module = tmp_path / "_generated" / "relu_sum_my.py"
    assert module.is_file() and f"TABLE = {str(table.resolve())!r}" in module.read_text()
    before = module.stat().st_mtime_ns
    act = ReLUSumActivation(table, use_triton=True)
    assert Path(act.spec.module.__file__) == module and module.stat().st_mtime_ns == before  # reused, not rewritten
    x = torch.randn(100, requires_grad=True)
    act(x).sum().backward()
    y = torch.randn(10)
    assert torch.allclose(ReLUSumActivation(table)(y), act(y), rtol=1e-6, atol=1e-7)  # Triton vs twin: to rounding
    with pytest.raises(ValueError, match="save it and export it first"):  # a table in memory has no kernels
        ReLUSumActivation(table_files.load(table))
    packaged = table_files.load("relu_sum/silu-k3-derivative")  # unless it is a packaged table's definition
    assert torch.equal(ReLUSumActivation(packaged.to_json())(y), ReLUSumActivation("silu-k3-derivative")(y))


def test_export_out_dir_feeds_the_drop_ins_kernels_dir(tmp_path):
    """`approxbp export TABLE --out-dir DIR` and `ReLUSumActivation(TABLE, kernels_dir=DIR)` name one folder; nothing
    is written next to the table."""
    from approxbp.kernels import InvActivation, ReLUSumActivation

    table = table_files.save(table_files.load("relu_sum/gelu-k2-derivative") | {"activation": "my-gelu"},
                             tmp_path / "t" / "my.json")
    out = tmp_path / "build" / "kernels"
    assert main(["export", str(table), "--out-dir", str(out)]) == 0
    act = ReLUSumActivation(table, use_triton=True, kernels_dir=out)
    assert Path(act.spec.module.__file__) == out / "relu_sum_my.py"
    assert not (table.parent / "_generated").exists()
    x = torch.randn(300, requires_grad=True)
    act(x).sum().backward()
    twin = torch.randn(300)
    assert torch.allclose(act(twin), act.spec.module.activation_twin(twin),
                          rtol=1e-6, atol=1e-7)  # Triton vs its generated twin: to rounding
    with pytest.raises(RuntimeError, match="approxbp export .*gelu-fast.json --out-dir"):
        InvActivation("gelu-fast", kernels_dir=tmp_path / "inv")  # a drop-in never generates kernels
    assert main(["export", "invact/gelu-fast", "--out-dir", str(tmp_path / "inv")]) == 0
    packaged = InvActivation("gelu-fast", use_triton=True, kernels_dir=tmp_path / "inv")
    assert Path(packaged.spec.module.__file__) == tmp_path / "inv" / "invact_gelu_fast.py"


def test_use_triton_without_cuda_or_interpreter_says_so_in_one_line():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "from approxbp.kernels import ReGELU2; ReGELU2(use_triton=True)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert r.returncode != 0 and "TRITON_INTERPRET=1" in r.stderr.splitlines()[-1]


def test_fit_invact_is_exported():
    from approxbp.fitting import fit_invact

    assert table_files.validate(fit_invact("gelu", "paper").table)["form"] == "paper"


def test_atlas_fits_what_is_missing(capsys, tmp_path):
    from approxbp.approximations import get_activation
    from approxbp.fitting.atlas import _table
    from approxbp.fitting.relu_sum import fit_relu_sum

    act = get_activation("x*sigmoid(1.3*x)")
    t = _table("relu_sum", f"{act.name}-k2-primitive", tmp_path,
               lambda: fit_relu_sum(act, 2, "primitive", progress=False).table, "a custom activation")
    assert t.bits == 2 and "fitting it now" in capsys.readouterr().err
    assert len(list((tmp_path / "relu_sum").glob("*.json"))) == 1


def test_bdia_analyze_prints_its_key_numbers(tmp_path, capsys):
    assert main(["bdia", "analyze", "--blocks", "40", "--level", "9", "--dtype", "float32", "--out", str(tmp_path),
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "max reconstruction error after 40 blocks" in out and "online" in out


def _readme_commands() -> dict[str, list[str]]:
    """Every `approxbp …` command in the bash blocks of the README and the docs pages (continuations joined,
    comments dropped, each once) → the earlier commands of its block that write a file it reads (--out)."""
    out: dict[str, list[str]] = {}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), re.S):
            seen: list[str] = []
            for cmd in block.replace("\\\n", " ").splitlines():
                cmd = " ".join(cmd.split("  #")[0].split())
                if not cmd.startswith("approxbp "):
                    continue
                words = shlex.split(cmd)
                needs = [c for c in seen if (w := shlex.split(c)).count("--out")
                         and w[w.index("--out") + 1] in words[1:] and "--out" not in words]
                out.setdefault(cmd, needs)
                seen.append(cmd)
    return out


#: Not run verbatim (each over minutes, and covered elsewhere): reproduce --full and --memory
#: (tests/approxbp/papers/test_paper_memory.py runs memory rows and the --memory verdicts), the toy GPT, figures, atlas.
SLOW = ("reproduce --full", "reproduce --memory", "train-toy", "figures", "atlas")


def test_the_docs_show_commands():
    assert len(_readme_commands()) >= 6


def _slow_command(cmd: str, needs: list[str]) -> bool:
    """Over ~5 s and covered elsewhere by default: symbolic regression, reproduce (the README's install command
    runs it), the planner (tests/approxbp/planner/test_plan.py), the sweep (test_sweep_…), a k = 3 annealing fit, and
    commands that first repeat another command's fit."""
    return bool(needs) or any(s in cmd for s in ("--form sr", "approxbp reproduce", "approxbp plan", "approxbp sweep",
                                                 "--bits 3"))


@pytest.mark.parametrize("cmd", [pytest.param(c, marks=pytest.mark.slow) if _slow_command(c, needs) else c
                                 for c, needs in _readme_commands().items() if not any(s in c for s in SLOW)])
def test_readme_commands_run_verbatim(cmd, tmp_path, tmp_path_factory, monkeypatch):
    """Each command of the README and the docs pages, run as written after the commands that write its input
    (one test each, so that they run in parallel): its words through approxbp's main, in this process (under
    TRITON_INTERPRET=1, as the suite runs) from a fresh folder; `approxbp` itself starts in
    test_version_and_python_dash_m. A command that writes another's input runs once per test run: the files it
    wrote are copied into each reader's folder (the docs' k = 3 fit, 15 s, was run by three tests)."""
    for c in _readme_commands()[cmd]:
        written = once_per_run(tmp_path_factory, f"readme-{hashlib.sha256(c.encode()).hexdigest()[:16]}",
                               lambda c=c: _files_written_by(c, tmp_path_factory.mktemp("writer"), monkeypatch))
        for name, text in written.items():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text(text)
    code, out = _run_in(cmd, tmp_path, monkeypatch)
    assert code == 0, (cmd, out)


def _files_written_by(cmd: str, folder: Path, monkeypatch) -> dict[str, str]:
    """{path relative to ``folder``: text} of every file ``cmd`` wrote into the empty ``folder`` (it must succeed)."""
    code, out = _run_in(cmd, folder, monkeypatch)
    assert code == 0, (cmd, out)
    return {str(p.relative_to(folder)): p.read_text() for p in folder.rglob("*") if p.is_file()}


def _run_in(cmd: str, folder: Path, monkeypatch) -> tuple[int, str]:
    """(exit code, the last 3000 characters printed) of ``cmd`` through approxbp's main, run in ``folder``."""
    monkeypatch.chdir(folder)
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(out):
        try:
            code = main(shlex.split(cmd)[1:])
        except SystemExit as done:  # --version and --help exit from argparse
            code = done.code
    return code, out.getvalue()[-3000:]


@pytest.mark.slow
def test_figures_into_a_new_folder_replots_and_never_retrains(tmp_path, monkeypatch, capsys):
    from approxbp.fitting import atlas

    from approxbp.papers import bdia_experiments as bdia

    def no_training(**kw):
        raise AssertionError("figures retrained the toy GPT")

    monkeypatch.setattr(bdia, "train_toy_gpt", no_training)
    monkeypatch.setattr(atlas, "write_atlas", lambda out, *a: [])  # the slow parts are tested elsewhere
    monkeypatch.setattr(bdia, "write_analysis", lambda out, **kw: [])
    assert main(["figures", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "bdia_toy_gpt.png").is_file() and (tmp_path / "relu_sum_gelu_k2.png").is_file()
    assert "retraining" not in capsys.readouterr().err


def test_figure_commands_default_to_the_checkout_not_the_current_folder(tmp_path, monkeypatch):
    from approxbp.papers.figures import figures_dir

    monkeypatch.chdir(tmp_path)
    assert figures_dir(None) == ROOT.resolve() / "docs" / "figures"
    assert figures_dir(tmp_path / "x") == tmp_path / "x"


@pytest.mark.slow
def test_sweep_fits_every_combination_and_writes_named_tables(tmp_path, capsys):
    from approxbp.approximations import tables as table_files

    from approxbp.commands.sweep import parse_bits

    assert parse_bits("1-3,5") == [1, 2, 3, 5] and parse_bits("2, 2") == [2]
    assert main(["sweep", "--activation", "gelu", "--activation", "swish2=x*sigmoid(2*x)", "--bits", "1-2",
                 "--objective", "both", "--out-dir", str(tmp_path), "--restarts", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "8 of 8 fits in" in out and "swish2" in out
    written = sorted(p.name for p in tmp_path.glob("*.json"))
    assert len(written) == 8 and "swish2-k2-derivative.json" in written
    t = table_files.load(tmp_path / "gelu-k2-primitive.json")
    packaged = table_files.load("relu_sum/gelu-k2-primitive")
    assert t.loss == pytest.approx(packaged.loss, rel=1e-9)  # the packaged optimum
    assert main(["sweep", "--activation", "gelu", "--bits", "9"]) == 2
    assert main(["sweep", "--activation", "gelu", "--bits", "1", "--out-dir", str(tmp_path)]) == 2  # exists


def test_sweep_checks_every_activation_first_and_carries_on_past_a_failed_fit(monkeypatch, capsys):
    """A sweep aborted on the first activation it could not fit, after fitting the ones before it."""
    import approxbp.fitting.sweep as R

    assert main(["sweep", "--activation", "gelu", "--activation", "x", "--bits", "1", "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert "does not tend to 0" in captured.err and "gelu" not in captured.out  # refused before any fit
    real = R.fit_relu_sum

    def fails_for_silu(act, *a, **k):
        if act.name == "silu":
            raise ValueError("a numerical failure\nover two lines")
        return real(act, *a, **k)

    monkeypatch.setattr(R, "fit_relu_sum", fails_for_silu)
    assert main(["sweep", "--activation", "silu", "--activation", "gelu", "--bits", "1", "--restarts", "1",
                 "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "silu            1 primitive  FAILED (ValueError)" in out and "1 of 2 fits in" in out
    assert "failed: silu k=1 primitive: a numerical failure over two lines" in out


def test_the_version_is_written_once_and_is_the_changelogs():
    """Issue 60: ``--version`` printed 0.1.0 (pyproject's literal) while CHANGELOG.md named 0.2. The version is
    approxbp.__version__ alone: pyproject reads it, ``--version`` prints it, the changelog's first heading names it."""
    import tomllib

    import approxbp

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "approxbp.__version__"}
    heading = next(ln for ln in (ROOT / "CHANGELOG.md").read_text().splitlines() if ln.startswith("## "))
    release = re.match(r"## (\d+\.\d+)", heading).group(1)
    assert approxbp.__version__.startswith(release + "."), (approxbp.__version__, heading)
    r = _run("--version")
    assert r.returncode == 0 and r.stdout == f"approxbp {approxbp.__version__}\n"


def test_an_atlas_of_your_own_activation_is_written_where_you_run_it(tmp_path, monkeypatch, capsys):
    """``approxbp atlas --activation EXPR`` without --out writes into ./atlas (said), never into the checkout's
    docs/figures; the default atlas (gelu, silu) still goes there."""
    import json

    from approxbp.fitting import atlas

    seen = []

    def record(out, *args, **kwargs):  # where the atlas would go; its JSON written in tmp_path only
        seen.append(out)
        written = tmp_path / "written.json"
        written.write_text(json.dumps({"rows": {}}))
        return [written]

    monkeypatch.setattr(atlas, "write_atlas", record)
    monkeypatch.chdir(tmp_path)
    assert main(["atlas", "--activation", "x*tanh(exp(x))", "--name", "tanhexp", "--no-progress"]) == 0
    assert seen[-1] == Path("atlas") and f"writing into {tmp_path / 'atlas'}" in capsys.readouterr().out
    assert main(["atlas", "--no-progress"]) == 0
    assert seen[-1] == ROOT.resolve() / "docs" / "figures"
