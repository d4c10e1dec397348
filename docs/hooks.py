"""mkdocs hook: the installed layout of the package for mkdocstrings.

The repository maps ``approxbp.approximations`` to ``approximations/`` and so on (pyproject's package-dir), which a
static reader of the source tree cannot follow. Before the build, ``build/api_src/approxbp`` is laid out as the
installed package, of symbolic links to the sources, and the handler reads from there (build/ is ignored by git).
"""

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"approximations": "approximations", "fitting": "fitting", "kernels": "kernels", "data": "data",
            "planner": "approxbp/planner", "papers": "approxbp/papers", "commands": "approxbp/commands"}


def on_startup(command, dirty):  # before mkdocstrings resolves its paths (its on_config runs before ours)
    top = ROOT / "build" / "api_src" / "approxbp"
    top.mkdir(parents=True, exist_ok=True)
    wanted = {p.name: p for p in (ROOT / "approxbp").glob("*.py") if p.name != "__main__.py"}
    wanted.update({name: ROOT / folder for name, folder in PACKAGES.items()})
    for link in top.iterdir():
        if link.name not in wanted:
            link.unlink()
    for name, target in wanted.items():
        link = top / name
        if not link.is_symlink():
            link.symlink_to(target)


# ---- cross-references: a moved or renamed name breaks the build ------------------------------------------------
#: Source folders and the package each one is installed as.
SOURCES = {"approximations": "approxbp.approximations", "fitting": "approxbp.fitting", "kernels": "approxbp.kernels",
           "approxbp": "approxbp"}
#: A Sphinx role in a docstring or comment: :func:`~.plan_moves.timed`.
ROLE = re.compile(r":(mod|func|class|data|meth|attr|exc|obj):`([^`]+)`")
#: A dotted library name or a repository file, in backticks on a docs page.
PAGE_NAME = re.compile(r"`(approxbp(?:\.[A-Za-z_]\w*)+)(?:\(\))?`")
PAGE_FILE = re.compile(r"`((?:approxbp|kernels|fitting|approximations|benchmarks|tests|notebooks|data|docs)/"
                       r"[\w/.\-]+\.(?:py|json|md|ipynb))`")


def _found(dotted: str) -> bool:
    """``dotted`` is a module, or an attribute path inside the longest importable module prefix."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            annotated = getattr(obj, "__annotations__", {}) if isinstance(obj, type) else {}
            if not hasattr(obj, name) and name not in annotated:
                return False
            obj = getattr(obj, name, None)
        return True
    return False


def resolves(target: str, module: str) -> bool:
    """A role's target as Sphinx reads it in ``module``: ``~`` only shortens the text; ``.name`` is searched from
    the module up through its packages; a plain name is absolute, in the module or a package above it, or an
    attribute of a class the module defines (``:meth:`to_json``` in that class's docstring)."""
    name = re.sub(r"\(\)$", "", target.split("<")[-1].rstrip(">").lstrip("~"))
    chain = module.split(".")
    bases = [".".join(chain[:i]) for i in range(len(chain), 0, -1)]
    if name.startswith("."):
        return any(_found(f"{base}{name}") for base in bases)
    if _found(name) or any(_found(f"{base}.{name}") for base in bases):
        return True
    mine = importlib.import_module(module)
    return "." not in name and any(isinstance(v, type) and v.__module__ == module and _found(f"{module}.{k}.{name}")
                                   for k, v in vars(mine).items())


def _module_of(path: Path, folder: str) -> str:
    parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
    return ".".join([SOURCES[folder], *(parts[:-1] if parts[-1] == "__init__" else parts)])


def unresolved() -> list[str]:
    """Every reference that names nothing: roles in the library's sources (generated modules aside) and dotted
    names or files in backticks on the docs pages."""
    bad = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "generated" in path.parts:
                continue
            module = _module_of(path, folder)
            bad += [f"{path.relative_to(ROOT)}: :{m[1]}:`{m[2]}`" for m in ROLE.finditer(path.read_text())
                    if not resolves(m[2], module)]
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text(encoding="utf-8")
        bad += [f"docs/{page.name}: `{m[1]}`" for m in PAGE_NAME.finditer(text) if not _found(m[1])]
        bad += [f"docs/{page.name}: `{m[1]}`" for m in PAGE_FILE.finditer(text) if not (ROOT / m[1]).exists()]
    return bad


def on_pre_build(config):
    """Strict cross-references: the build fails on a reference to a name or file that is not there."""
    from mkdocs.exceptions import PluginError

    bad = unresolved()
    if bad:
        raise PluginError("references to names or files that are not there:\n  " + "\n  ".join(bad))
