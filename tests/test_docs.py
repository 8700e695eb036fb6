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


def test_the_cfg_job_and_dry_run_commands_written_in_the_docs_run(tmp_path, console, monkeypatch):
    """Every ``spark-bench ... --cfg job`` / ``dry_run=true`` line: it composes and prints (a dry run of a hub model
    may end with 'the run would stop: …' here, where no hub is reachable, never with a config error). Run in this
    process from the console script's entry (tests/conftest.py ``console``), from the repository root."""
    import shlex

    monkeypatch.chdir(ROOT)
    commands = [line.split("#")[0].strip() for page in DOCS for line in page.read_text().splitlines()
                if re.search(r"spark-bench\s.*(--cfg job|dry_run=true)", line)]
    assert len(commands) >= 3
    for command in commands:
        args = [f"output_root={tmp_path}", "hub_timeout_s=1", *shlex.split(command)[1:]]  # Hydra: overrides first
        code, out, err = console(args)
        if "--cfg" in args:
            assert code == 0 and "benchmark:" in out, (command, err[-500:])
        else:
            assert "spark-bench (dry run)" in out, (command, err[-500:])
            errors = [line for line in err.splitlines() if "error:" in line]
            assert all("the run would stop:" in line for line in errors), (command, errors)


# ---- docs say what the program does (issue 46): figures from the program, every shell command run or marked -------

MAKEFILE = (ROOT / "Makefile").read_text()


def _script(name: str):
    """A ``scripts/bench`` script as a module (its functions, without running it)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_documented_gpu_hours_are_the_planners():
    """README's and docs/tables.md's per-target H100 hours ("decode + ≤ prefill", summed over a target's experiments)
    and tables.md's KV GiB per sample are those of results/bench/plan_hours.json (scripts/bench/plan_hours.py, ``make
    bench``: what ``make <target> DRY_RUN=true`` prints), which covers every target of the Makefile that runs
    experiments; its table1 entry is recomputed here by the planner (every entry: about a minute), so a planner or
    experiment change that moves a figure fails here until the file and the docs say it."""
    import json

    hours = json.loads((ROOT / "results" / "bench" / "plan_hours.json").read_text())
    script = _script("plan_hours")
    assert set(script.targets(MAKEFILE)) == set(hours)
    assert script.experiment("table1") == hours["table1"]["experiments"]["table1"]
    checked, drift = 0, []
    for page in (ROOT / "README.md", ROOT / "docs" / "tables.md"):
        for target, rest in re.findall(r"^\| `([\w.\-]+)` \|(.*)\|$", page.read_text(), flags=re.M):
            cells = [c.strip() for c in rest.split("|")]
            shown = next((c for c in cells if re.fullmatch(r"[\d.]+ \+ ≤ [\d.]+", c)), None)
            if target not in hours or shown is None:
                continue
            entry = hours[target]
            want = [f"{entry['h100_decode_h']:.1f} + ≤ {entry['h100_prefill_h']:.1f}"]
            got = [shown]
            if page.name == "tables.md":
                kv = [e["kv_gib_per_sample"] for e in entry["experiments"].values()]
                want.append(" / ".join(f"{v:.1f}" for v in kv[:1 if "(+" in rest else None]))
                got.append(cells[-1])
            checked += 1
            if got != want:
                drift.append(f"{page.name} {target}: says {got}, the planner {want}")
    assert checked >= 20 and not drift, drift


def _shell_commands() -> list[tuple[str, str]]:
    """``(page, command)`` for every line of every ```bash block of the README and docs/ (continuations joined)."""
    out = []
    for page in DOCS:
        for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", page.read_text(), flags=re.S):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                if line.strip():
                    out.append((page.name, line.strip()))
    return out


# a command that a test cannot run here says why in its comment
MARKS = ("(needs a GPU", "(needs the hub", "(after make demo", "(on a cluster")


def test_every_shell_command_in_the_docs_is_run_or_marked(tmp_path, monkeypatch, capsys):
    """Each command of a ```bash block: a ``make`` target that exists; a spark-bench console script whose command line
    composes and validates here like the real start-up (every job of a ``-m``; hub sources not needed), the
    export one run with tiny sizes so the next command's data file exists; or marked with why it cannot run here."""
    import shlex

    import spark_bench.cli as cli
    from spark_bench.checks import check_group_choices, check_launcher
    from spark_bench.commandline import compose_jobs

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    commands = _shell_commands()
    assert len(commands) >= 25
    unrun = []
    for page, line in commands:
        command, _, comment = line.partition("  #")
        if any(mark in comment for mark in MARKS):
            continue
        words = shlex.split(command)
        if words[0] == "make":
            assert re.search(rf"^{re.escape(words[1])}:", MAKEFILE, flags=re.M), (page, line)
            continue
        tool = words[0].removeprefix(".venv/bin/")
        if tool not in ("spark-bench", "spark-bench-export", "spark-bench-memory"):
            unrun.append(f"{page}: {line}")
            continue
        args = [a.replace("tests/fixtures", str(ROOT / "tests" / "fixtures")) for a in words[1:] if a != "--cfg"
                and a != "job"]
        if tool == "spark-bench-export":  # tiny sizes, the documented tasks (offline): the file the next command reruns
            given = any(a.startswith("benchmark.tasks=") for a in args)
            args += ["model=tiny-llama", *([] if given else ["benchmark.tasks=[niah_single_1]"]),
                     "benchmark.num_samples=1", "benchmark.length=512"]
            from spark_bench import tools

            monkeypatch.setattr("sys.argv", [tool, *args])
            tools.export()
            continue
        check_group_choices(args)
        check_launcher(args)
        for _, cfg in compose_jobs(args):
            cli.validate(cfg, sources=False)
    assert not unrun, unrun


def test_the_documented_gpu_peaks_are_the_planners():
    """docs/gpu.md's predicted peaks ("peak + margin = needed GiB", decode batches) are those the planner wrote to
    results/bench/planner_peaks.json (scripts/bench/planner_peaks.py, ``make bench``; its latest section), row by
    row; the table1 row is recomputed here by the planner itself (the other rows place 32B-70B models: minutes)."""
    import json

    from spark_bench import memory

    peaks = json.loads((ROOT / "results" / "bench" / "planner_peaks.json").read_text())
    latest = list(peaks.values())[-1]
    keys = ["tab_full_llama3.1-70b", "tab_full_llama3.1-70b 2xH200", "tab_full_qwen3-32b 2xH100",
            "tab_full_qwen3-32b 1xH100", "tab_full_llama3.1-8b", "table1"]
    text = (ROOT / "docs" / "gpu.md").read_text()
    rows = re.findall(r"\| ([\d.]+) \+ ([\d.]+) = ([\d.]+) GiB, (?:decode )?(?:batches of (\d+)|all (\d+) rows)", text)
    assert len(rows) == len(keys), rows
    for key, (peak, margin, needed, batch, every) in zip(keys, rows):
        run = latest[key]
        for shown, k in zip((peak, margin, needed), ("fullest_gib", "margin_gib", "needed_gib")):
            assert abs(float(shown) - run[k]) <= 0.05 + 1e-9, (key, k, shown, run[k])  # one decimal of the JSON's two
        assert int(batch or every) == run["decode_batch"] and (not every or run["decode_batch"] == run["rows"]), key
    script = _script("planner_peaks")
    from spark_bench.cli import memory_prediction, validate
    from spark_bench.commandline import compose

    cfg = compose(["memory.limit_gib=79", *script.RUNS["table1"]])
    model, configs = validate(cfg, sources=False)
    prediction = memory_prediction(cfg, model, configs)
    fullest = max(prediction.devices, key=lambda d: d.needed)
    assert (round(fullest.peak / memory.GIB, 2), prediction.decode_batch) == \
        (latest["table1"]["fullest_gib"], latest["table1"]["decode_batch"])


def test_the_documented_memory_planner_figures_are_the_planners():
    """The README's ``spark-bench-memory`` command and its figures (largest batch in 80 GiB per config), and
    docs/development.md's, are what the planner gives for that very command line (its ``memory.seq_len``)."""
    from spark_bench import memory as planner
    from spark_bench.cli import validate
    from spark_bench.commandline import compose

    readme = (ROOT / "README.md").read_text()
    (line,) = [line for line in readme.splitlines() if "spark-bench-memory" in line and "#" in line]
    command, _, comment = line.partition("  #")
    args = command.split()[1:]
    assert "memory.seq_len=8192" in args  # the figures hold at 8K tokens, not at the run's own prompt length
    said = {label: int(n) for label, n in re.findall(r"(full|SparK\(0\.\d\)|SnapKV\+SparK\(0\.\d\)) (\d+)", comment)}
    development = (ROOT / "docs" / "development.md").read_text()
    found = re.search(r"At 8K tokens it gives full (\d+), SparK\(0\.5\) (\d+), SparK\(0\.8\) (\d+) and SnapKV\(50%\)"
                      r"\+SparK\(0\.8\) (\d+)", development.replace("\n  ", " ").replace("On LLaMA-3.1-8B at", "At"))
    assert len(said) == 3 and found, (comment, found)
    cfg = compose(args)
    model, configs = validate(cfg, sources=False)
    names = {"full": "Full", "SparK(0.5)": "SparK(0.5)", "SparK(0.8)": "SparK(0.8)",
             "SnapKV+SparK(0.8)": "SnapKV+SparK(0.8) @0.5"}
    wanted = {c.label: c for c in configs if c.label in names.values()}
    batch = {label: planner.plan(c, model, cfg.memory.seq_len, cfg.memory.gen_len, cfg.memory.cap_gib,
                                 cfg.memory.overhead_gib).max_batch for label, c in wanted.items()}
    assert {label: batch[names[label]] for label in said} == said
    assert [batch[names[k]] for k in ("full", "SparK(0.5)", "SparK(0.8)", "SnapKV+SparK(0.8)")] == \
        [int(n) for n in found.groups()]
