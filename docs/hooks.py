"""mkdocs hook: the installed layout of the package for mkdocstrings.

The repository maps ``approxbp.approximations`` to ``approximations/`` and so on (pyproject's package-dir), which a
static reader of the source tree cannot follow. Before the build, ``build/api_src/approxbp`` is laid out as the
installed package, of symbolic links to the sources, and the handler reads from there (build/ is ignored by git).
"""

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
