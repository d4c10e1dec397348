"""The layers' import direction: approximations ← fitting, approximations ← kernels, and the top layer
(approxbp/: CLI, reproduction, experiments) above both. Read from the source (ast), so a lazy import inside a
function counts too."""

import ast
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: layer folder → the approxbp subpackages it may import (besides itself)
ALLOWED = {"approximations": {"data"}, "fitting": {"approximations", "data"},
           "kernels": {"approximations", "data"}}
TOP = {"cli", "blocks", "cost", "__main__"}  # modules of the top-layer package folder (besides its packages)
LAYERS = {"approximations", "fitting", "kernels", "data"}


def imported_layers(path: Path) -> set[str]:
    """The approxbp layers (or top-layer modules) a source file imports, by absolute or bare name."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
        if isinstance(node, ast.ImportFrom) and node.module == "approxbp":
            names = [f"approxbp.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "approxbp" and len(parts) > 1:
                found.add(parts[1])
            elif parts[0] in LAYERS:  # the bare folder names
                found.add(parts[0])
    return found


def _sources(layer: str):
    return sorted(p for p in (ROOT / layer).rglob("*.py") if "generated" not in p.parts[-2:-1])


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_imports_point_one_way(layer):
    wrong = {}
    for path in _sources(layer):
        bad = imported_layers(path) - ALLOWED[layer] - {layer}
        if bad:
            wrong[str(path.relative_to(ROOT))] = sorted(bad)
    assert not wrong, f"imports against the layer direction: {wrong}"


def test_generated_modules_import_only_triton_the_helpers_and_the_torch_forms():
    """A generated module imports triton, the shared Triton helpers and, for its PyTorch twin, the function set's
    torch forms (approximations.backends, which imports no sympy): nothing else of approxbp."""
    for path in (ROOT / "kernels" / "generated").glob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert imported_layers(path) <= {"kernels", "approximations"}, path
        assert set(re.findall(r"from approxbp\.(\S+) import", text)) <= {"kernels.generated.triton_helpers",
                                                                           "approximations.backends"}, path


#: The kernels wing's rooms and the rooms each may import (issue 48): model rewriting above the run time, the run time
#: above the generated modules; the build side writes the generated modules from the run time's specs.
ROOMS = {"rewrite": {"ops", "generated"}, "ops": {"generated"}, "codegen": {"ops", "generated"}, "generated": set()}


def rooms_imported(path: Path) -> set[str]:
    """The kernels rooms a module of one room imports (relative or absolute, lazy imports included)."""
    room = path.relative_to(ROOT / "kernels").parts[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            dotted = (node.module or "").split(".") if node.level != 1 else [room]
            if node.level == 0:
                dotted = dotted[2:] if dotted[:2] == ["approxbp", "kernels"] else []
            if node.level == 2 and not node.module:
                dotted = [a.name for a in node.names]
                found.update(dotted)
                continue
            found.update(dotted[:1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[2] for a in node.names if a.name.startswith("approxbp.kernels."))
    return found - {room, ""}


def test_the_kernels_wing_is_three_rooms_importing_downward():
    """kernels/ holds only its rooms (and the front door, __init__.py): ``rewrite`` (model rewriting) imports ``ops``
    (the run time), which imports ``generated``; ``codegen`` (the build side) is imported by none of them."""
    loose = sorted(p.name for p in (ROOT / "kernels").glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules outside the kernels rooms: {loose}"
    assert {p.name for p in (ROOT / "kernels").iterdir() if p.is_dir() and p.name != "__pycache__"} == set(ROOMS)
    wrong = {str(p.relative_to(ROOT)): sorted(bad) for room in ROOMS for p in (ROOT / "kernels" / room).glob("*.py")
             if (bad := rooms_imported(p) - ROOMS[room])}
    assert not wrong, wrong


def test_the_room_checker_sees_an_upward_import(tmp_path, monkeypatch):
    fake = tmp_path / "kernels" / "ops"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("from ..rewrite.patch import patch_model\nfrom .glu import x\n"
                                 "def f():\n    from approxbp.kernels.codegen import export\n")
    monkeypatch.setitem(rooms_imported.__globals__, "ROOT", tmp_path)
    assert rooms_imported(fake / "bad.py") == {"rewrite", "codegen"}


def top_imports(path: Path) -> set[str]:
    """The top layer's parts a file imports: ``cli``, ``commands``, ``planner``, ``papers`` (lazy imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [f"{node.module}.{a.name}" for a in node.names]
                 if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
        found.update(n.split(".")[1] for n in names if n.startswith("approxbp.") and len(n.split(".")) > 1)
    return found & {"cli", "commands", "planner", "papers"}


#: The top layer's parts and what each may import of the others (issue 48): the command line above everything,
#: the papers above the planner; no library code imports the command line.
TOP_PARTS = {"planner": set(), "papers": {"planner"}, "cost.py": set(), "blocks.py": set()}


def test_library_code_never_imports_the_command_line():
    wrong = {}
    for part, allowed in TOP_PARTS.items():
        paths = [ROOT / "approxbp" / part] if part.endswith(".py") else sorted((ROOT / "approxbp" / part).rglob("*.py"))
        for path in paths:
            if bad := top_imports(path) - allowed - {part}:
                wrong[str(path.relative_to(ROOT))] = sorted(bad)
    assert not wrong, wrong


def test_the_top_checker_sees_the_command_line(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from approxbp.commands.plan import parse\nfrom approxbp import papers\n")
    assert top_imports(bad) == {"commands", "papers"}


def test_the_checker_sees_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from approxbp.kernels.ops.custom_ops import relu_sum\n    import approxbp.cli\n"
                   "from approxbp import fitting\n")
    assert imported_layers(bad) == {"kernels", "cli", "fitting"}


def test_top_layer_modules_exist():
    assert {p.stem for p in (ROOT / "approxbp").glob("*.py")} >= TOP


TABLE_FIELDS = ("family", "activation", "expression", "source", "bits", "objective", "interval", "knots", "weights",
                "levels", "loss", "constraint_residual", "metrics", "provenance", "created", "reference", "form",
                "turning_point", "f_T", "left", "right", "combined")


def table_subscripts(path: Path) -> list[str]:
    """``x["field"]`` subscripts with a table field name, except on lines marked ``# not a table`` (result rows,
    Pareto-front entries: other dicts that happen to share a key)."""
    hits, text = [], path.read_text(encoding="utf-8")
    lines = text.splitlines()
    for node in ast.walk(ast.parse(text)):
        if (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
                and node.slice.value in TABLE_FIELDS and "not a table" not in lines[node.lineno - 1]):
            where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
            hits.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    return hits


def test_tables_are_read_by_attribute_outside_the_tables_module():
    """Fields of a table are read as attributes of ReluSumTable / InvActTable; only
    approximations/tables.py and the schema and checks it reads with (table_schema.py, table_checks.py) read the JSON
    by key. (Result rows and metrics dicts use other keys.)"""
    allowed = {ROOT / "approximations" / name for name in ("tables.py", "table_schema.py", "table_checks.py")}
    hits = [h for layer in ("approximations", "fitting", "kernels", "approxbp")
            for p in _sources(layer) if p not in allowed for h in table_subscripts(p)]
    assert not hits, hits


def test_the_subscript_checker_sees_a_key_read(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(t, e):\n    return t['knots'], t.knots, t['other'], t[\"left\"]\n"
                   "def g(e):\n    return e['expression']  # not a table\n")
    assert [h.split(" ", 1)[1] for h in table_subscripts(bad)] == ["t['knots']", "t['left']"]


#: Test folders and the source each mirrors (tests/kernels/ the run time and the build side, tests/kernels/rewrite/
#: the model rewriting).
MIRRORS = {"approximations": "approximations", "fitting": "fitting", "kernels": "kernels",
           "kernels/rewrite": "kernels/rewrite", "approxbp": "approxbp",
           "approxbp/planner": "approxbp/planner", "approxbp/papers": "approxbp/papers", "benchmarks": "benchmarks",
           "notebooks": "notebooks", "docs": "docs"}


def test_tests_mirror_the_source_tree():
    """A test file lives in the folder of what it tests; only whole-tree checks (this file) sit at the
    top of tests/."""
    tests = ROOT / "tests"
    misplaced = [str(p.relative_to(tests)) for p in tests.rglob("test_*.py")
                 if p.parent != tests and p.parent.relative_to(tests).as_posix() not in MIRRORS]
    top = sorted(p.name for p in tests.glob("test_*.py"))
    assert not misplaced and top == ["test_architecture.py"], (misplaced, top)
    assert all((ROOT / source).exists() for source in MIRRORS.values())


CODE_LAYERS = ("approxbp", "kernels", "approximations", "fitting")


def test_no_function_over_60_lines_and_no_file_over_500():
    """Hand-written code (generated modules aside) in small pieces: a function fits on a screen, a file holds one
    concern."""
    sources = [p for layer in CODE_LAYERS for p in _sources(layer)]
    long = [f"{p.relative_to(ROOT)}:{n.name} ({n.end_lineno - n.lineno + 1} lines)" for p in sources
            for n in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.end_lineno - n.lineno + 1 > 60]
    big = [f"{p.relative_to(ROOT)} ({n} lines)" for p in sources
           if (n := len(p.read_text(encoding="utf-8").splitlines())) > 500]
    assert not long and not big, (long, big)


def build_side_imports(path: Path) -> list[str]:
    """Imports of sympy or of the code generator in a kernels source file, outside a module ``__getattr__`` (where
    ``kernels.export`` is resolved when asked for)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    lazy = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "__getattr__"
            for n in ast.walk(f)}
    found = []
    for node in ast.walk(tree):
        if id(node) in lazy:
            continue
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [("." * node.level) + (node.module or "") + (":" + ",".join(a.name for a in node.names))]
                 if isinstance(node, ast.ImportFrom) else [])
        found += [n for n in names if n.split(".")[0] == "sympy" or "codegen" in n]
    return found


def test_the_kernels_run_time_never_imports_sympy_or_the_code_generator():
    """Every kernels module but the generator itself (the dynamic check is
    tests/kernels/test_runtime.py)."""
    wrong = {p.name: build_side_imports(p) for p in _sources("kernels") if "codegen" not in p.parts}
    assert not {k: v for k, v in wrong.items() if v}, wrong


def test_the_build_side_checker_sees_an_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import sympy as sp\ndef f():\n    from .codegen import export\n"
                   "def __getattr__(name):\n    from . import codegen\n")
    assert build_side_imports(bad) == ["sympy", ".codegen:export"]


def layer_modules(package: str) -> dict[str, Path]:
    """Dotted name inside ``package`` → source file, subpackages included (``commands.plan``; a subpackage's
    ``__init__`` is the subpackage itself), generated code aside."""
    root = ROOT / package
    found = {}
    for p in _sources(package):
        parts = p.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name:
            found[name] = p
    return found


def module_imports(path: Path, package: str) -> set[str]:
    """The modules of one layer folder (``package``: approximations, fitting, kernels, or approxbp, the top layer)
    a source file imports, by relative or absolute name, at module level or inside a function."""
    mods = layer_modules(package)
    prefix = "approxbp" if package == "approxbp" else f"approxbp.{package}"  # the top layer: approxbp/ itself
    here = ".".join(path.relative_to(ROOT / package).with_suffix("").parts[:-1])  # the file's subpackage
    found = set()

    def resolve(dotted: str, names: list[str]) -> None:
        for n in names:  # ``from pkg import module``
            if f"{dotted}.{n}".strip(".") in mods:
                found.add(f"{dotted}.{n}".strip("."))
        while dotted and dotted not in mods:  # ``from pkg.module import name``
            dotted = dotted.rpartition(".")[0]
        if dotted:
            found.add(dotted)

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = here.split(".") if here else []
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                resolve(".".join([*base, *module.split(".")]).strip("."), [a.name for a in node.names])
            elif module == prefix or module.startswith(prefix + "."):
                resolve(module.removeprefix(prefix).strip("."), [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(prefix + "."):
                    resolve(a.name.removeprefix(prefix + "."), [])
    me = ".".join(p for p in path.relative_to(ROOT / package).with_suffix("").parts if p != "__init__")
    return found - {me}


def import_cycles(package: str) -> list[set[str]]:
    """The strongly connected components of more than one module in a layer's import graph (Tarjan)."""
    graph = {name: module_imports(p, package) for name, p in layer_modules(package).items()}
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("package", ["approximations", "fitting", "kernels", "approxbp"])
def test_no_import_circle_inside_a_layer(package):
    """Imports inside functions count: a lazy import hides a circle from Python, not from this test."""
    assert import_cycles(package) == []


def test_the_cycle_finder_sees_a_circle(tmp_path, monkeypatch):
    pkg = tmp_path / "approximations"
    pkg.mkdir()
    (pkg / "a.py").write_text("def f():\n    from .b import g\n")
    (pkg / "b.py").write_text("from approxbp.approximations.a import f\n")
    (pkg / "c.py").write_text("from . import a\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert import_cycles("approximations") == [{"a", "b"}]


def test_the_cycle_finder_sees_a_circle_through_a_subpackage(tmp_path, monkeypatch):
    pkg = tmp_path / "approxbp"
    (pkg / "commands").mkdir(parents=True)
    (pkg / "commands" / "__init__.py").write_text("")
    (pkg / "commands" / "plan.py").write_text("def f():\n    from approxbp.memory import g\n")
    (pkg / "memory.py").write_text("def g():\n    from approxbp.commands import plan\n")
    (pkg / "cli.py").write_text("from .commands import plan\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert import_cycles("approxbp") == [{"commands.plan", "memory"}]


def test_every_folder_with_an_init_is_a_listed_package():
    """A non-editable install (pip install ., as on a GPU machine) ships every subpackage of the source folders."""
    import tomllib

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, roots = set(tool["packages"]), tool["package-dir"]
    found = set()
    for package, folder in roots.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            if "__pycache__" in rel.parts or rel.parts[:1] == ("_generated",):
                continue
            found.add(".".join((package, *rel.parts)))
    assert found - listed == set(), f"folders missing from [tool.setuptools] packages: {sorted(found - listed)}"


def test_the_names_the_changelog_lists_as_removed_are_gone():
    """CHANGELOG.md's table of removed 0.1 names is the contract: each named attribute is absent from its module."""
    import importlib
    import re

    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    removed = [re.match(r"\| `([\w.]+)", line).group(1) for line in text.splitlines()
               if re.match(r"\| `approxbp\.", line) and line.count(" | ") == 1]
    assert len(removed) >= 4, removed
    for dotted in removed:
        module, _, name = dotted.rpartition(".")
        assert not hasattr(importlib.import_module(module), name), dotted
    moved = [line.split(" | ") for line in text.splitlines() if line.startswith("| `approxbp.") and
             line.count(" | ") == 2 and line.rstrip().endswith("` |")]
    assert len(moved) >= 8, moved
    for old_homes, names, home in moved:
        home = re.findall(r"`([\w.]+)`", home)[0]
        for name in re.findall(r"`(\w+)`", names):
            assert hasattr(importlib.import_module(home), name), (home, name)
            for old in re.findall(r"`([\w.]+)`", old_homes):
                assert not hasattr(importlib.import_module(old), name), (old, name)


def test_the_modules_the_changelog_lists_as_moved_import_only_from_their_new_home():
    """CHANGELOG.md's "module moved" rows: the old dotted name is no module, the new one is."""
    import importlib

    moved = re.findall(r"^\| `([\w.]+)` → `([\w.]+)` \|$", (ROOT / "CHANGELOG.md").read_text(encoding="utf-8"), re.M)
    assert len(moved) >= 20, moved
    for old, new in moved:
        importlib.import_module(new)
        if old not in {new.rpartition(".")[0] for _, new in moved}:  # a room now holds the old name
            with pytest.raises(ModuleNotFoundError):
                importlib.import_module(old)


def test_the_docs_map_names_every_module_of_the_top_layer():
    """docs/index.md's map lists every module of the top layer and every CLI subcommand's module (issue 48)."""
    page = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    row = next(line for line in page.splitlines() if line.startswith("| `approxbp/` |"))
    top = [p.name for folder in ("", "planner", "papers") for p in (ROOT / "approxbp" / folder).glob("*.py")
           if p.name != "__init__.py"]
    commands = [p.stem for p in (ROOT / "approxbp" / "commands").glob("*.py") if p.name != "__init__.py"]
    missing = [n for n in top if f"`{n}`" not in row] + [n for n in commands if f"`{n}`" not in row
                                                          and f"`{n}.py`" not in row]
    assert not missing, missing


def test_no_module_dispatches_on_a_table_family_name():
    """A family is chosen through its layer's registry (approximations/families.py's ``member``), never by comparing
    its name: ``family == "relu-sum" … else`` served any other family the invact branch (issue 48). A family's own
    modules (relu_sum.py, invact.py) may check that a table is theirs."""
    import re

    pattern = re.compile(r"family\s*(==|!=)\s*[\"'](relu-sum|invact)|family in \([\"'](relu-sum|invact)"
                         r"|\[0\]\s*==\s*[\"'](relu-sum|invact)")
    paths = [p for layer in (*sorted(ALLOWED), "approxbp") for p in _sources(layer)
             if p.stem not in ("relu_sum", "invact")]
    found = [f"{path.relative_to(ROOT)}:{i}" for path in paths
             for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert not found, found


def test_no_module_assigns_to_sys_modules_or_warns_of_a_rename():
    """A module behaves the same however it was found: nothing hands out another module in its place
    (``sys.modules[...] = …``), and 0.2, the first release, keeps no 0.1 spellings (``warn_renamed``; issue 48)."""
    found = []
    for path in (p for layer in (*sorted(ALLOWED), "approxbp") for p in _sources(layer)):
        text = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(text)):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if any(isinstance(t, ast.Subscript) and ast.unparse(t.value) == "sys.modules" for t in targets):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
        if "warn_renamed" in text:
            found.append(f"{path.relative_to(ROOT)}: warn_renamed")
    assert not found, found


KERNELS_PROBE = """
import importlib.util, sys
import transformers.utils.import_utils as hf
import approxbp.kernels
hf.is_kernels_available.cache_clear(); hf.is_kernels_available()  # transformers imports `kernels` when it finds one
spec = importlib.util.find_spec("kernels")
copies = sorted(n for n, m in sys.modules.items() if n.split(".")[0] == "kernels")
print(spec is None or spec.origin != approxbp.kernels.__file__, copies == [], approxbp.kernels.__name__)
"""


def test_the_kernels_folder_is_only_ever_imported_as_approxbp_kernels():
    """No repository root on sys.path under the test command (`pytest`), nor in a Python a test starts from the
    repository root (conftest sets PYTHONSAFEPATH): kernels/ is never found as a top-level `kernels` (a second copy
    registered every custom op again; issue 48 item 4)."""
    import importlib.util
    import subprocess
    import sys

    import approxbp.kernels

    spec = importlib.util.find_spec("kernels")
    assert spec is None or spec.origin != approxbp.kernels.__file__
    run = subprocess.run([sys.executable, "-c", KERNELS_PROBE], cwd=ROOT, capture_output=True, text=True, check=True)
    assert run.stdout.split() == ["True", "True", "approxbp.kernels"], run.stdout + run.stderr


def test_the_probe_sees_the_folder_when_the_repository_root_is_on_sys_path():
    """The check above can fail: with the repository root on sys.path (what `python -m pytest` adds), `kernels` is
    found and its origin is the folder."""
    import subprocess
    import sys

    code = f"import sys; sys.path.insert(0, {str(ROOT)!r})\n" + KERNELS_PROBE.replace(
        "hf.is_kernels_available.cache_clear(); hf.is_kernels_available()", "")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert run.stdout.split()[0] == "False", run.stdout + run.stderr



def test_every_pythonpath_a_test_sets_goes_through_python_path():
    """A PYTHONPATH built by hand can hold an empty entry, the working directory, which PYTHONSAFEPATH does not drop
    (the FSDP test's did, and transformers 5.25 then imported kernels/ as Hugging Face's `kernels`: CI at stop 76):
    each one a test sets goes through `_helpers.python_path`."""
    found = [f"{path.relative_to(ROOT)}:{i}" for path in sorted((ROOT / "tests").rglob("*.py"))
             for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"""["']PYTHONPATH["']\s*[]:]""", line) and "python_path(" not in line]
    assert not found, found

def test_a_value_shared_by_the_xdist_workers_is_computed_once_per_run(tmp_path, monkeypatch):
    """``_once.once_per_run``: the first worker computes and writes, the next reads (the model-coverage rows, 5 min,
    were measured three times in one CI run when worksteal brought a worker back to their module); another run
    (another folder) or a run without xdist computes afresh."""
    from _once import once_per_run

    class Factory:  # what pytest's tmp_path_factory gives a worker: its own folder inside the run's
        def __init__(self, run, worker):
            self.base = tmp_path / run / worker

        def getbasetemp(self):
            self.base.mkdir(parents=True, exist_ok=True)
            return self.base

    calls = []

    def compute():
        calls.append(1)
        return {"rows": [1.5, "a"]}

    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    got = [once_per_run(Factory("run1", w), "rows", compute) for w in ("popen-gw0", "popen-gw1", "popen-gw0")]
    assert got == [{"rows": [1.5, "a"]}] * 3 and len(calls) == 1
    once_per_run(Factory("run2", "popen-gw0"), "rows", compute)
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    once_per_run(Factory("run1", "popen-gw0"), "rows", compute)
    assert len(calls) == 3
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")  # pickled: any picklable value, read back by the next worker
    got = [once_per_run(Factory("run3", w), "plan", lambda: calls.append(1) or {frozenset({1}), 2.5}, pickled=True)
           for w in ("popen-gw0", "popen-gw1")]
    assert got == [{frozenset({1}), 2.5}] * 2 and len(calls) == 4


def _public_definitions(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return {n for n in names if not n.startswith("_")}


def _all_of(tree: ast.Module) -> list[str] | None:
    """The module's ``__all__``: a literal list, or ``list(NAME)`` of a dict literal (a lazy package's exports)."""
    literals = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name)}
    value = literals.get("__all__")
    if isinstance(value, ast.Call) and ast.unparse(value.func) == "list" and isinstance(value.args[0], ast.Name):
        value = literals[value.args[0].id]
    return None if value is None else list(ast.literal_eval(value))


def test_a_process_a_test_starts_runs_one_openmp_thread():
    """conftest.py exports OMP_NUM_THREADS=1 (unless set): a notebook kernel's or a CLI run's two OpenMP threads
    beside two busy xdist workers wait on each other at every parallel region (the BDIA notebook: 202 s beside one
    busy core, 25 s with one thread), and OpenBLAS, which numpy and scipy carry, takes its thread count from it too
    (two threads per worker before)."""
    import subprocess
    import sys

    code = "import os, torch; print(os.environ.get('OMP_NUM_THREADS'), torch.get_num_threads())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    want = os.environ["OMP_NUM_THREADS"]
    assert done.stdout.split() == [want, want], done.stdout


def test_every_module_says_what_is_public():
    """``__all__`` in every module of the four layers (generated code and ``__main__`` aside; issue 48): every public
    top-level definition is listed (an internal one is ``_``-prefixed), and every listed name is defined or imported
    there."""
    wrong = {}
    for path in (p for layer in (*sorted(ALLOWED), "approxbp") for p in _sources(layer) if p.name != "__main__.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        listed = _all_of(tree)
        if listed is None:
            wrong[str(path.relative_to(ROOT))] = "no __all__"
            continue
        imported = {(a.asname or a.name).split(".")[0] for n in ast.walk(tree)
                    if isinstance(n, ast.Import | ast.ImportFrom) for a in n.names}
        lazy = any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body)
        unlisted = _public_definitions(tree) - set(listed)
        undefined = set() if lazy else set(listed) - _public_definitions(tree) - imported
        if unlisted or undefined:
            wrong[str(path.relative_to(ROOT))] = {"not in __all__": sorted(unlisted), "not defined": sorted(undefined)}
    assert not wrong, wrong


def test_the_public_names_checker_sees_an_unlisted_definition(tmp_path):
    tree = ast.parse("import os\n__all__ = ['f', 'os']\ndef f(): pass\ndef g(): pass\ndef _h(): pass\nX = 1\n")
    assert _all_of(tree) == ["f", "os"] and _public_definitions(tree) - set(_all_of(tree)) == {"g", "X"}


def test_the_docs_speak_of_features_not_of_the_tracker():
    """An issue number tells a reader of the docs nothing: the pages name features and the commands that measure
    them (the tracker's numbers belong in the changelog and the commits)."""
    found = [f"{page.name}:{n}: {line.strip()[:60]}" for page in sorted((ROOT / "docs").glob("*.md"))
             for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"\bissues? #?\d+", line, re.IGNORECASE)]
    assert not found, found


def test_the_api_pages_docstrings_speak_of_features_not_of_the_tracker():
    """The API reference renders the library's docstrings (docs/api.md): no issue number in them either."""
    found = [f"{p.relative_to(ROOT)}:{n}" for folder in ("approxbp", "kernels", "fitting", "approximations")
             for p in sorted((ROOT / folder).rglob("*.py"))
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"\bissues? #?\d+", line, re.IGNORECASE)]
    assert not found, found


def test_library_code_never_patches_with_unittest_mock():
    """Library code replaces a library's function only through approxbp/planner/compat.py (by name, refusing a
    missing one), never with unittest.mock, whose guards hide a rename."""
    found = [str(p.relative_to(ROOT)) for folder in ("approxbp", "kernels", "fitting", "approximations")
             for p in (ROOT / folder).rglob("*.py") if "unittest" in p.read_text(encoding="utf-8")]
    assert not found, found


def one_letter_aliases(path: Path) -> list[str]:
    """``import … as X`` with a one-letter alias of an approxbp module, in a source file."""
    return [f"{a.name} as {a.asname}" for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.Import | ast.ImportFrom) for a in node.names
            if a.asname and len(a.asname) == 1 and "approxbp" in f"{getattr(node, 'module', '') or ''}.{a.name}"]


def test_the_table_module_is_never_imported_under_a_letter():
    """Issue 70: ``tables as T`` sat beside ``ia.T``, the turning point; the coefficient-table module is imported as
    ``table_files`` (or by its names) everywhere, tests included."""
    found = [f"{p.relative_to(ROOT)}: {a}" for folder in ("approxbp", "kernels", "fitting", "approximations", "tests")
             for p in sorted((ROOT / folder).rglob("*.py")) for a in one_letter_aliases(p) if a.startswith("tables ")]
    assert not found, found


def test_the_alias_checker_sees_a_letter(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from approxbp.approximations import tables as T\nimport numpy as np\n")
    assert one_letter_aliases(bad) == ["tables as T"]


def test_a_fit_success_is_never_a_constant():
    """``success`` is the fitter's own verdict (scipy's meaning: the solver says whether it met its criterion), not
    a literal True."""
    found = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "fitting").rglob("*.py"))
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"\bsuccess\s*=\s*True\b", line)]
    assert not found, found


def test_the_planner_keeps_no_sentinel_key_in_an_assignment():
    """An assignment maps activation layers to options, nothing else: the MS-norms' choice is a value of its own
    (``Assignment.ms_norm``), the chunked loss and the parts recomputed in every block are arguments of the step
    (``plan_step.apply(…, chunked_loss=, parts=)``), not keys mixed into the per-layer dict."""
    found = [str(p.relative_to(ROOT)) for p in (ROOT / "approxbp" / "planner").rglob("*.py")
             if any(key in p.read_text(encoding="utf-8") for key in ("__ms_norm__", "(recompute part)", "PART_KEY"))]
    assert not found, found


def _loss_keys(path: Path) -> list[int]:
    """Lines of a string literal "(loss)" (schema 1's key for the chunked loss among a plan's block moves), outside
    the one assignment that names it for the schema-1 reader (``_SCHEMA_1_LOSS = "(loss)"``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    reader = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
              and [getattr(t, "id", None) for t in n.targets] == ["_SCHEMA_1_LOSS"]}
    return [n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and n.value == "(loss)" and id(n) not in reader]


def test_the_chunked_loss_is_no_key_among_a_plans_block_moves():
    """A plan's ``moves["moves"]`` maps module paths to moves; the chunked loss is ``moves["chunked_loss"]["chosen"]``
    and ``apply_moves(…, chunked_loss=)``. Only the schema-1 reader (approxbp/planner/result.py) names the old key."""
    files = [*(ROOT / "approxbp").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
    found = [f"{p.relative_to(ROOT)}:{n}" for p in sorted(files) for n in _loss_keys(p)]
    assert not found, found


def test_the_loss_key_checker_sees_a_key(tmp_path):
    (tmp_path / "m.py").write_text('_SCHEMA_1_LOSS = "(loss)"\nmoves = {"(loss)": "chunked-loss"}\n')
    assert _loss_keys(tmp_path / "m.py") == [2]


def _subclasses_a_function(tree: ast.Module) -> list[str]:
    """Classes deriving from an autograd Function (``torch.autograd.Function``, ``Function``, ``FirstOrder``)."""
    bases = {"Function", "FirstOrder"}
    return [node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
            and any((b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "")) in bases for b in node.bases)]


def test_one_helper_defines_every_op():
    """The drop-ins' ops and the norm rewrite's are each one ``custom_ops.Op`` description (forward, backward, what is
    saved, fakes): no ``autograd.Function`` subclass in the rewrite room or in a family's op module, and
    ``torch.library.custom_op`` / ``register_autograd`` called only by the helper (kernels/ops/custom_ops.py)."""
    families = {"relu_sum.py", "invact.py", "norms.py", "glu.py", "norm_linear.py"}
    found = []
    for p in sorted((ROOT / "kernels").rglob("*.py")):
        if "generated" in p.parts or p.name == "custom_ops.py":
            continue
        text = p.read_text(encoding="utf-8")
        if "rewrite" in p.parts or p.name in families:
            found += [f"{p.relative_to(ROOT)}: class {c}" for c in _subclasses_a_function(ast.parse(text))]
        found += [f"{p.relative_to(ROOT)}: {call}" for call in ("custom_op(", "register_autograd(", "register_fake(")
                  if call in text]
    assert not found, found


def test_the_function_checker_sees_a_subclass():
    tree = ast.parse("class A(torch.autograd.Function): pass\nclass B(custom_ops.FirstOrder): pass\nclass C: pass")
    assert _subclasses_a_function(tree) == ["A", "B"]


#: Private PyTorch, as code spells it; only kernels/ops/torch_private.py may (the planner's Tracker subclasses
#: MemTracker, whose private peak update it overrides: named there).
_PRIVATE_TORCH = re.compile(r"\btorch\._|torch\.utils\._|\._cdata\b|\b_forward_ad\b")


def test_private_torch_is_used_in_one_home():
    found = {}
    for folder in ("approxbp", "kernels", "fitting", "approximations"):
        for p in (ROOT / folder).rglob("*.py"):
            if p.name == "torch_private.py" or "generated" in p.parts:
                continue
            code = [line for line in p.read_text(encoding="utf-8").splitlines() if not line.lstrip().startswith("#")]
            if hits := [line.strip() for line in code if _PRIVATE_TORCH.search(line)]:
                found[str(p.relative_to(ROOT))] = hits
    assert not found, found


def test_every_key_kept_in_a_modules_dict_has_one_home():
    """Each key approxbp keeps in a module's ``__dict__`` is spelled once, in kernels/rewrite/swaps.py, prefixed
    ``_approxbp_``; nowhere else does library code write such a literal, and nothing is set on a tensor (the
    shared-output norm's z once rode on its y as an attribute; now its ZHandoff holds it)."""
    from approxbp.kernels.rewrite import swaps

    assert all(k.startswith("_approxbp_") for k in swaps.KEYS if k != swaps.EXPERT_GATE), swaps.KEYS
    found = {}
    for folder in ("approxbp", "kernels", "fitting", "approximations"):
        for p in (ROOT / folder).rglob("*.py"):
            if p.name == "swaps.py" or "generated" in p.parts:
                continue
            hits = [n.value for n in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
                    if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("_approxbp_")]
            if hits:
                found[str(p.relative_to(ROOT))] = hits
    assert not found, found


def test_no_module_tells_tables_apart_by_an_isinstance_chain_over_the_families():
    """A typed table is recognised by ``tables.is_table`` (any registered family), never by naming the table
    classes together (``isinstance(t, ReluSumTable | InvActTable)`` sent a new family's table down the wrong
    branch); tables.py, which defines them, is the one home of that union."""
    pattern = re.compile(r"isinstance\([^)]*(ReluSumTable|InvActTable)\s*[|,]\s*[\w.]*(ReluSumTable|InvActTable)")
    found = [f"{p.relative_to(ROOT)}:{i}" for layer in (*sorted(ALLOWED), "approxbp") for p in _sources(layer)
             if p.name != "tables.py"
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert not found, found


def _plan_part_fields() -> set[str]:
    from dataclasses import fields

    from approxbp.planner import pareto, plan_parts
    from approxbp.planner.training import Setup

    types = [getattr(plan_parts, n) for n in plan_parts.__all__] + [pareto.CurvePoint, pareto.CompiledAt]
    return {f.name for t in types for f in fields(t)} - {f.name for f in fields(Setup)}  # a set-up's own changes


def plan_subscripts(path: Path, names: set[str]) -> list[str]:
    """``x["peak"]``-style reads of a plan part's field by its name (``approxbp.planner.plan_parts``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [f"{path.name}:{n.lineno} {ast.unparse(n)}" for n in ast.walk(tree)
            if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and n.slice.value in names]


def test_the_planner_passes_types_not_string_keyed_dicts():
    """Issue 70: a plan's parts (its steps, MS-norms, layers, moves, the Pareto curve's points) cross the planner's
    functions as dataclasses; only the JSON's reader (``planner/result.py``, whose ``read_plan`` checks a file's
    fields before they are typed) and the types themselves read one of their fields by key."""
    names = _plan_part_fields()
    allowed = {ROOT / "approxbp" / "planner" / n for n in ("result.py", "plan_parts.py")}
    planner = [p for p in _sources("approxbp") if "planner" in p.parts or p.name in ("trainer.py", "paper_memory.py")]
    hits = [h for p in planner if p not in allowed for h in plan_subscripts(p, names)]
    assert not hits, hits


def test_the_plan_subscript_checker_sees_a_key_read(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(plan, d):\n    return plan.after['peak'], plan.after.peak, d['other']\n")
    assert [h.split(" ", 1)[1] for h in plan_subscripts(bad, {"peak"})] == ["plan.after['peak']"]
