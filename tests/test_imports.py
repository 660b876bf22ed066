"""The imports code written for Dew's predecessor uses: the user's notebook's import lines (read
from the notebook beside the repository, ``../shared/spec/``, where it is; skipped elsewhere), and
the line of the user's own code, ``from dew.training import prepare_process, Layout, MeshSpec,
Checkpoints``, which every clone runs. Also: no two modules of Dew import each other, and the
repository's ``kernels/`` folder is ``dew.kernels`` only, never a top-level ``kernels``."""

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.helpers import child_env
from tests.test_notebook import NOTEBOOK, notebook_script

USER_IMPORT = (
    "from dew.training import prepare_process, Layout, MeshSpec, Checkpoints, Trainer, "
    "TrainState, DEFAULT_RULES"
)


def test_the_user_import_line_names_dews_own_objects():
    namespace = {}
    exec(USER_IMPORT, namespace)
    import dew
    import dew.layout
    import dew.training.runtime

    assert namespace["prepare_process"] is dew.training.runtime.prepare_process
    assert namespace["DEFAULT_RULES"] is dew.layout.DEFAULT_RULES
    for name in ("Layout", "MeshSpec", "Checkpoints", "Trainer", "TrainState"):
        assert namespace[name] is getattr(dew, name), name


def notebook_imports() -> list[str]:
    """Every import statement of the notebook's code cells (``test_notebook.notebook_script``: its
    cells less the ``%pip`` line, indentation restored), as written."""
    tree = ast.parse(notebook_script())
    return [
        ast.unparse(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
    ]


@pytest.mark.skipif(not NOTEBOOK.exists(), reason=f"the user's notebook is not at {NOTEBOOK}")
def test_the_notebooks_import_lines_run():
    statements = notebook_imports()
    assert any("dew" in s for s in statements), statements
    namespace = {}
    for statement in statements:
        exec(statement, namespace)


# The folders whose modules the import graph covers, and the package each installs as
# (pyproject maps kernels/ to dew.kernels).
PACKAGES = (("dew", "dew"), ("kernels", "dew.kernels"))
ROOT = Path(__file__).resolve().parent.parent


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every module of Dew, by its installed name (a package by its own name, not ``__init__``)."""
    files = {}
    for folder, package in PACKAGES:
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            files[name] = path
    return files


def imported_modules(name: str, path: Path, files: dict[str, Path]) -> set[str]:
    """The modules of ``files`` that module ``name`` imports, anywhere in it (inside functions
    too: they tie the two modules all the same). A name is taken as the longest module it starts
    with; a package's ``__init__`` is not counted (importing a package from one of its own
    modules is the package re-exporting, not a dependency), nor the module itself or a package
    above it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for imported in names:
            while imported and imported not in files:
                imported = imported.rpartition(".")[0]
            if (
                imported
                and imported != name
                and not name.startswith(imported + ".")
                and files[imported].name != "__init__.py"
            ):
                found.add(imported)
    return found


def import_circles(files: dict[str, Path]) -> list[list[str]]:
    """The groups of modules that import each other, directly or round a circle (the strongly
    connected components of more than one module of the import graph)."""
    graph = {name: imported_modules(name, path, files) for name, path in files.items()}
    # Each module's reach (everything it imports, at any depth); two modules that reach each
    # other are in one circle.
    reach = {}
    for start in graph:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        reach[start] = seen
    circles = {
        tuple(sorted({start} | {other for other in reach[start] if start in reach[other]}))
        for start in graph
        if start in reach[start]
    }
    return sorted(list(c) for c in circles)


def test_no_module_of_dew_imports_one_that_imports_it_back():
    # The before-stop hook's check (its ast walk over dew/ and kernels/): the planner imports the
    # step engine, never the reverse, and so on for every pair.
    assert import_circles(module_files()) == []


def test_the_circle_check_sees_an_import_inside_a_function(tmp_path):
    # The check itself, on a planted pair: a module-level import one way, a function-level import
    # back (the shape of the planning <-> trainer circle this test was written for).
    (tmp_path / "dew" / "training").mkdir(parents=True)
    (tmp_path / "kernels").mkdir()
    for init in ("dew", "dew/training", "kernels"):
        (tmp_path / init / "__init__.py").write_text("from dew.training import trainer\n")
    (tmp_path / "dew" / "planning.py").write_text("from dew.training.trainer import Trainer\n")
    (tmp_path / "dew" / "training" / "trainer.py").write_text(
        "def choose():\n    from dew.planning import choose_remat\n"
    )
    (tmp_path / "dew" / "training" / "step.py").write_text("from . import trainer\n")
    assert import_circles(module_files(tmp_path)) == [["dew.planning", "dew.training.trainer"]]


def _python_at_the_root(code: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    """``python -c code`` run from the repository's root (where ``kernels/`` would win a
    top-level import: the current directory leads sys.path), with ``pythonpath`` after it."""
    env = child_env()
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_from_the_root_import_kernels_is_the_installed_package_and_dew_kernels_is_dews(tmp_path):
    # Hugging Face's `kernels` as transformers imports it, stood in by a package of that name on
    # the path: from the root it must be what `import kernels` gives, submodules too, while
    # dew.kernels stays Dew's flash attention.
    installed = tmp_path / "site" / "kernels"
    installed.mkdir(parents=True)
    (installed / "__init__.py").write_text('WHO = "installed"\n')
    (installed / "hub.py").write_text("X = 7\n")
    run = _python_at_the_root(
        "import kernels, kernels.hub, dew.kernels; print(kernels.WHO, kernels.hub.X, "
        "dew.kernels.flash_attention.__module__)",
        tmp_path / "site",
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["installed", "7", "dew.kernels.attention"]
    # With none installed, the folder does not answer to the name either.
    run = _python_at_the_root("import kernels")
    assert run.returncode == 1
    assert run.stderr.splitlines()[-1] == "ModuleNotFoundError: No module named 'kernels'"


def test_the_kernels_folder_installs_as_dew_kernels():
    # What an install (editable or a wheel) takes from pyproject.toml: the folder is the package
    # dew.kernels, and there is no top-level package but dew. (A wheel built by `pip wheel .` on
    # 2026-12-06 held dew/kernels/__init__.py and the twelve kernel modules, no kernels/.)
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"dew.kernels": "kernels"}
    assert "dew.kernels" in setuptools["packages"]
    assert {name.split(".")[0] for name in setuptools["packages"]} == {"dew"}
    assert (ROOT / "kernels" / "__init__.py").is_file()
