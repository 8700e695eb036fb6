"""The docs are code: every ```python block of docs/library.md (then the README's) runs, in order, in one namespace
(the page's snippets build on each other), on the embedded SmolLM2, offline; every relative link and anchor of the
README and docs/ resolves; every ``--cfg job`` / ``dry_run=true`` command written in them runs."""

import importlib.util
import re

import pytest
from conftest import ROOT


def python_blocks(path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_the_library_page_runs(capsys, smollm2, monkeypatch):
    from spark_bench import api

    load = api.load  # the page's load("smollm2-135m") gets the session's model (its loader is tested elsewhere)
    monkeypatch.setattr(api, "load", lambda name="smollm2-135m", **kw: smollm2 if name == "smollm2-135m" and not kw
                        else load(name, **kw))
    blocks = python_blocks(ROOT / "docs" / "library.md")
    assert len(blocks) >= 5
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/library.md", "exec"), namespace)
    printed = capsys.readouterr().out
    assert "bytes held" in printed and "of the key entries pruned" in printed
    (readme,) = python_blocks(ROOT / "README.md")  # the README's one snippet, in the same process
    exec(compile(readme, "README.md", "exec"), namespace)
    assert namespace["out"].shape[1] > namespace["lm"].tokenizer(namespace["document"], return_tensors="pt").input_ids.shape[1]
    assert isinstance(namespace["text"], str) and len(namespace["batch"]) == 2 and len(namespace["more"]) == 1
    assert namespace["samples"].shape[0] == 2


def test_the_own_method_snippet_runs(capsys, smollm2, monkeypatch):
    """docs/development.md "Your own method in one file": the class, registered by name, composes with SparK."""
    from spark_bench import api
    from spark_bench.methods import registry

    monkeypatch.setattr(api, "load", lambda name="smollm2-135m", **kw: smollm2)
    (block,) = python_blocks(ROOT / "docs" / "development.md")
    namespace: dict = {}
    try:
        exec(compile(block, "docs/development.md", "exec"), namespace)
    finally:
        registry._REGISTERED.pop("top_value_norm", None)
    assert "top_value_norm+SparK(0.8) @0.5" in capsys.readouterr().out
    assert namespace["pruned"].kv_bytes < namespace["alone"].kv_bytes


@pytest.mark.skipif(importlib.util.find_spec("kvpress") is None,
                    reason="kvpress is not installed here: make test-compat runs this snippet")
def test_the_kvpress_snippet_runs(capsys, smollm2, monkeypatch):
    """docs/library.md "SparK over your kvpress press" (its ```python kvpress block), where kvpress is installed."""
    from spark_bench import api

    monkeypatch.setattr(api, "load", lambda name="smollm2-135m", **kw: smollm2)
    (block,) = re.findall(r"```python kvpress\n(.*?)```", (ROOT / "docs" / "library.md").read_text(), flags=re.S)
    namespace: dict = {}
    exec(compile(block, "docs/library.md", "exec"), namespace)
    assert "kvpress:SnapKV+SparK(0.8) @0.5" in capsys.readouterr().out
    assert namespace["pruned"].context.kv_bytes < namespace["alone"].context.kv_bytes


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def anchors(path) -> set[str]:
    """GitHub's heading anchors of a Markdown file: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in DOCS:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            file, _, anchor = target.partition("#")
            resolved = (page.parent / file).resolve() if file else page
            if not resolved.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def test_every_page_says_who_it_is_for():
    for page in DOCS[1:]:
        first = next(line for line in page.read_text().splitlines()[1:] if line.strip())
        assert first.startswith("For "), (page.name, first)
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


def test_the_cfg_job_and_dry_run_commands_written_in_the_docs_run(tmp_path):
    """Every ``spark-bench ... --cfg job`` / ``dry_run=true`` line: it composes and prints (a dry run of a hub model
    may end with 'the run would stop: …' here, where no hub is reachable, never with a config error)."""
    import shlex
    import subprocess
    import sys

    commands = [line.split("#")[0].strip() for page in DOCS for line in page.read_text().splitlines()
                if re.search(r"spark-bench\s.*(--cfg job|dry_run=true)", line)]
    assert len(commands) >= 3
    for command in commands:
        args = [f"output_root={tmp_path}", "hub_timeout_s=1", *shlex.split(command)[1:]]  # Hydra: overrides first
        out = subprocess.run([sys.executable, "-m", "spark_bench.cli", *args], capture_output=True, text=True,
                             timeout=300, cwd=ROOT, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
        if "--cfg" in args:
            assert out.returncode == 0 and "benchmark:" in out.stdout, (command, out.stderr[-500:])
        else:
            assert "spark-bench (dry run)" in out.stdout, (command, out.stderr[-500:])
            errors = [line for line in out.stderr.splitlines() if "error:" in line]
            assert all("the run would stop:" in line for line in errors), (command, errors)
