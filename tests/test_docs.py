"""The docs are code: every ```python block of docs/library.md runs, in order, in one namespace (the page's
snippets build on each other), on the embedded SmolLM2, offline."""

import re

from conftest import ROOT


def python_blocks(path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_the_library_page_runs(capsys):
    blocks = python_blocks(ROOT / "docs" / "library.md")
    assert len(blocks) >= 5
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/library.md", "exec"), namespace)
    printed = capsys.readouterr().out
    assert "bytes held" in printed and "of the key entries pruned" in printed
    assert isinstance(namespace["text"], str) and len(namespace["batch"]) == 2 and len(namespace["more"]) == 1
    assert namespace["samples"].shape[0] == 2
