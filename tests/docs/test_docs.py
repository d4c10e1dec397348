"""The documentation: the site builds with --strict, the README stays short and its example runs."""

import os
import re
import subprocess
import sys

import pytest
from _helpers import ROOT


@pytest.mark.slow
def test_the_docs_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs need the dev extras (mkdocs-material, mkdocstrings-python)")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in ("patch_model", "fit_relu_sum", "traced_step", "ReLUSum"):  # the reference has the docstrings
        assert name in api, name


def test_every_docs_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages == set(re.findall(r":\s*(\S+\.md)", nav))


def test_the_readme_is_short_and_links_to_pages_that_exist():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / link).is_file(), link


@pytest.mark.slow
def test_the_readme_example_runs_and_saves_memory():
    pytest.importorskip("transformers")
    code = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[0]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    before, after = map(int, re.search(r"saved for backward: (\d+) → (\d+) bytes", r.stdout).groups())
    assert after < before


@pytest.mark.slow
def test_the_relu_sum_api_example_prints_what_its_comment_says():
    """docs/relu-sum.md's worked example: its first lines run as written and fit.message is the quoted text."""
    page = (ROOT / "docs" / "relu-sum.md").read_text(encoding="utf-8")
    block = page.split("## Python API, worked example", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    lines = block.splitlines()
    upto = next(i for i, line in enumerate(lines) if line.startswith("print(fit.message)"))
    namespace: dict = {}
    exec("\n".join(lines[:upto]), namespace)  # the page's own code (ours, not a user's)
    quoted = re.search(r'# "(.*)"', lines[upto])[1]
    assert namespace["fit"].message == quoted


def test_the_api_page_names_only_public_names_that_exist():
    """Every member docs/api.md lists is in its module's ``__all__`` (mkdocstrings skips a missing one silently)."""
    import importlib
    import re

    page = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    missing = []
    for module, members in re.findall(r"^::: ([\w.]+)\n    options:\n      members: \[([^\]]*)\]", page, re.M):
        listed = set(getattr(importlib.import_module(module), "__all__", ()))
        missing += [f"{module}.{m.strip()}" for m in members.split(",") if m.strip() not in listed]
    assert not missing, missing


def test_the_table_counts_in_the_docs_are_the_repositorys():
    """Issue 60: docs/kernels.md counted 83 relu-sum and 18 invact tables (89 and 26 were packaged) and
    docs/reproduce.md said --full regenerates every committed table. Both pages' counts are checked here against
    the packaged files and against what --full writes (approxbp.papers.reproduce.regenerated_names)."""
    from approxbp.approximations.tables import data_dir

    from approxbp.papers.reproduce import regenerated_names

    packaged = {family: {p.stem for p in (data_dir() / family).glob("*.json")} for family in ("relu_sum", "invact")}
    written = regenerated_names()
    assert all(set(written[f]) <= packaged[f] for f in packaged)  # --full writes only packaged tables
    kernels = (ROOT / "docs" / "kernels.md").read_text(encoding="utf-8")
    assert f"({len(packaged['relu_sum'])} relu-sum, {len(packaged['invact'])} invact packaged)" in kernels
    page = " ".join((ROOT / "docs" / "reproduce.md").read_text(encoding="utf-8").split())
    n, m = len(written["relu_sum"]), len(written["invact"])
    assert (f"{n} of the {len(packaged['relu_sum'])} packaged relu-sum tables and {m} of the "
            f"{len(packaged['invact'])} invact tables; the other {len(packaged['relu_sum']) - n} and "
            f"{len(packaged['invact']) - m}") in page
    others = sorted((packaged["relu_sum"] - set(written["relu_sum"])) | (packaged["invact"] - set(written["invact"])))
    assert all(o.startswith("hardswish-") or o.endswith("-exact") for o in others), others  # as the page says


def test_reproduces_time_is_written_once_with_its_commit():
    """Issue 60: `approxbp reproduce` took 10.7 s in the README and 15.1 s in docs/reproduce.md. One page states its
    time, with the commit and the machine it was measured on; the README links there."""
    pattern = re.compile(r"`approxbp reproduce`[^.]{0,40}? (?:in|takes) \d+(?:\.\d+)? s")
    pages = {p.name: " ".join(p.read_text(encoding="utf-8").split()) for p in [ROOT / "README.md",
                                                                               *(ROOT / "docs").glob("*.md")]}
    stated = {name: pattern.findall(text) for name, text in pages.items() if pattern.search(text)}
    assert list(stated) == ["reproduce.md"] and len(stated["reproduce.md"]) == 1, stated
    assert re.search(r"takes \d+\.\d s wall, .* at commit [0-9a-f]{7}", pages["reproduce.md"])


def _hooks():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_cross_reference_names_something_that_is_there():
    """The check the strict build runs (docs/hooks.py): Sphinx roles in the sources, dotted names and files on the
    pages."""
    hooks = _hooks()
    assert hooks.unresolved() == []


def test_the_cross_reference_check_sees_a_moved_name():
    hooks = _hooks()
    here = "approxbp.planner.plan_step"
    assert hooks.resolves("~.plan_moves.timed", here) and hooks.resolves("~.step_memory.traced_step", here)
    assert not hooks.resolves("timed", here)  # it lives in plan_moves: a bare name is not found from here
    assert not hooks.resolves("~.rewrite.Savings", "approxbp.kernels.rewrite.patch")  # a module that moved
    assert hooks.resolves("to_json", "approxbp.approximations.tables")  # a method of a class of the module
    assert not hooks.resolves("approxbp.kernels.ops.modules.RENDERERS", here)  # moved to the build side
