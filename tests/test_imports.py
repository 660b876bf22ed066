"""The imports code written for Dew's predecessor uses: the user's notebook's import lines (read
from the notebook beside the repository, ``../shared/spec/``, where it is; skipped elsewhere), and
the line of the user's own code, ``from dew.training import prepare_process, Layout, MeshSpec,
Checkpoints``, which every clone runs."""

import ast

import pytest

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
