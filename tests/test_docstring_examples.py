"""The Examples sections of the reference's docstrings run, and print what they show (doctest).

Those that train or run the attention kernels (``Trainer``, ``fit``, ``Checkpoints``,
``flash_attention``) take tens of seconds each and are left out; the rest run here, each group in
its own folder and namespace, in the order the docs read them (a later example may use an earlier
one's names, as ``read_meta``'s reads the corpus ``write_example_corpus`` wrote)."""

import doctest
import importlib

import pytest

GROUPS = {
    "layout and mesh": [
        "dew.layout.Layout",
        "dew.mesh.MeshSpec",
        "dew.models.build",
        "dew.models.causal_transformer.CausalTransformer",
    ],
    "token windows": [
        "dew.data.corpus.write_example_corpus",
        "dew.data.folder.TokenMeta",
        "dew.data.folder.read_meta",
        "dew.data.windows.TokenWindows",
        "dew.data.windows.WindowDataset",
        "dew.data.loading.Loading",
        "dew.data.loading.BatchStream",
    ],
    "tokenizers": [
        "dew.data.tokenizer.Tokenizer",
        "dew.data.tokenizer.ByteTokenizer",
        "dew.data.corpus.write_example_corpus",
        "dew.data.tokenizer.tokenizer_for",
        "dew.data.text.tokenize_files",
    ],
    "generate": ["dew.generation.generate"],
    "folder writer": ["dew.data.folder.TokenFolderWriter"],
    "write_token_folder": ["dew.data.folder.write_token_folder"],
    "collectives": [
        "dew.collectives.jaxpr.collectives",
        "dew.collectives.hlo.hlo_collectives",
        "dew.collectives.report.CollectiveReport",
    ],
}


def _object(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("group", list(GROUPS))
def test_docstring_examples_run_and_show_their_output(group, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # tokenize_files' example reads a folder of text and a .jsonl of two documents.
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("hello world\n")
    (tmp_path / "notes.jsonl").write_text('{"text": "héllo again"}\n{"text": "more"}\n')
    names: dict = {}
    parser = doctest.DocTestParser()
    for path in GROUPS[group]:
        docstring = _object(path).__doc__
        examples = parser.get_doctest(docstring, names, path, path, 0)
        assert examples.examples, f"{path} has no Examples section"
        report = []
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        runner.run(examples, out=report.append, clear_globs=False)
        assert runner.failures == 0, "".join(report)
        names = examples.globs  # the next example's names (a DocTest runs on a copy)
