"""One long format for every table — ``block, group, method, column, value`` — built from our runs or from the
paper's transcribed CSVs, so both render through the same code and can be set side by side.

``group`` is the base eviction method a ``+ThinK (λ)`` / ``+SparK (λ)`` row belongs to (the paper's CSVs leave it
implicit in row order; :func:`read_paper_csv` restores it).
"""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from spark_bench.methods.channel.leank import label_ratio
from spark_bench.methods.pipeline import CHANNEL_METHODS, DISPLAY, display, tell_apart
from spark_bench.report.layouts import Layout
from spark_bench.report.paper import paper_table
from spark_bench.results import parse_records, read_manifest
from spark_bench.tables import FIDELITY, FIDELITY_COLUMNS

COLUMNS = ["block", "group", "method", "column", "value"]
_LATEX = re.compile(r"^(?:\\[A-Za-z]+(?:\{[^}]*\}|[\d-]+)?\s*)+")


def clean_method(text: str) -> str:
    """``\\cdashline1-15 SnapKV`` → ``SnapKV``; ``+ThinK(0.5)`` → ``+ThinK (0.5)``; ``(0.5 + 0.3)`` →
    ``(0.5+0.3)`` (key + value ratios, as run labels write them)."""
    text = _LATEX.sub("", str(text)).strip()
    text = re.sub(r"\((\d[\d.]*)\s*\+\s*(\d[\d.]*)\)", r"(\1+\2)", text)  # +SparK (0.5 + 0.3) → (0.5+0.3)
    return re.sub(r"(\S)\(", r"\1 (", text)


def read_paper_csv(path: str | Path) -> pd.DataFrame:
    """A paper table (a shipped name such as ``tab_main``, or a CSV path) in the long format.

    ``name@PART`` (e.g. ``tab_app_full_ruler@8K``) keeps the blocks that start with ``PART`` (``8K input, …``) and
    names them as a run names its blocks: ``… full KV cache`` → no block, ``… 20% KV cache`` → ``KV 20%``."""
    part = None
    if "@" in str(path):
        path, part = str(path).split("@", 1)
    raw = pd.read_csv(paper_table(path), keep_default_na=False, dtype={"value": str})
    if part is not None:
        raw = raw[raw.block.astype(str).str.startswith(part)]
        if raw.empty:
            raise ValueError(f"paper table {path}: no block starts with {part!r}")
        raw = raw.assign(block=[_run_block(b) for b in raw.block])
    rows, group = [], ""
    for block, method, column, value in raw[["block", "method", "column", "value"]].itertuples(index=False):
        method = clean_method(method)
        if not method.startswith("+"):
            group = method
        rows.append((str(block).strip(), group, method, str(column).strip(), value))
    frame = pd.DataFrame(rows, columns=COLUMNS)
    frame["value"] = pd.to_numeric(frame["value"], errors="coerce")
    return frame


def _run_block(block: str) -> str:
    """``16K input, 20% KV cache`` → ``KV 20%``; ``…, KV-size 128`` → ``KV-size 128``; ``16K input, full KV
    cache`` → ``""`` (the full cache has no block)."""
    match = re.search(r"(\d+(?:\.\d+)?)% KV cache", block)
    if match:
        return budget_block(float(match.group(1)) / 100)
    match = re.search(r"KV-size (\d+)", block)  # LLaMA-3-8B-Instruct, KV-size 128 → KV-size 128
    return budget_block(int(match.group(1))) if match else ""


def budget_block(budget: float) -> str:
    return f"KV-size {budget:g}" if budget >= 1 else f"KV {100 * budget:g}%"


def row_names(method: dict) -> tuple[str, str, str]:
    """(block, group, row label) of a method config in the paper's style."""
    name = method["name"]
    eviction, _, channel = name.partition("+")
    if name in CHANNEL_METHODS:  # a channel method alone (every one the registry lists: think, spark, leank, …)
        eviction, channel = "", name
    block = budget_block(method["budget"]) if eviction not in ("", "full") else ""
    group = display(eviction) if eviction not in ("", "full") else "Vanilla"  # kvpress:<press>: its own name
    if not channel:
        return block, group, group
    label = display(channel)
    if channel == "leank":  # its ratio is the pruned fraction of its mask file (as its run label says)
        vr = method.get("value_ratio") or 0
        label += f" ({label_ratio(method.get('leank') or {})}{f'+{vr:g}' if vr else ''})"
    elif channel == "spark" and method.get("variant") == "top_p":
        label += f"-p ({method['top_p']:g})"
    elif channel == "spark" and method.get("variant") == "group":
        label += f"-g ({method['groups']})"
    elif channel == "spark" and method.get("variant") == "group_fork":
        label += "-g (fork)"
    else:
        vr = method.get("value_ratio") or 0
        label += f" ({method['ratio']:g}{f'+{vr:g}' if vr else ''})"
    if channel == "spark" and method.get("recovery", "degenerate") != "degenerate":
        label += f" [{method['recovery']}]"
    return block, group, ("+" + label) if eviction else label


def config_rows(preds: pd.DataFrame) -> list[tuple[pd.DataFrame, str, str, str]]:
    """(predictions, block, group, row label) per method config of one run; configs that would share a row (they
    differ only in options the paper's labels do not show, e.g. windows) are told apart by those options."""
    groups = [group for _, group in preds.groupby("config", sort=False)]
    names = [row_names(group.iloc[0]["method"]) for group in groups]
    keys = ["\t".join(name) for name in names]
    told = tell_apart(keys, [group.iloc[0]["method"] for group in groups])
    return [(group, block, base, method + tag[len(key):])
            for group, (block, base, method), key, tag in zip(groups, names, keys, told)]


RECOVERY_NAMES = {"gaussian": "Normal", "exponential": "Exponential", "degenerate": "Degenerate",
                  "fork_ranked_normal": "Normal (official code, ranked)",
                  "fork_ranked_exponential": "Exponential (official code, ranked)",
                  "fork_key_normal": "Normal (official code, key values)",
                  "fork_key_exponential": "Exponential (official code, key values)"}


def with_tags(label: str, tags: list[str]) -> str:
    """``label`` with ``key=value`` tags added to its bracket (``SnapKV @64 [window_size=64]`` + ``model=x`` →
    ``SnapKV @64 [window_size=64, model=x]``), the form :mod:`~spark_bench.report.compare` reads rows' options
    from."""
    if not tags:
        return label
    if label.endswith("]") and " [" in label and "=" in label[label.rindex(" ["):]:
        return f"{label[:-1]}, {', '.join(tags)}]"
    return f"{label} [{', '.join(tags)}]"


def run_tags(entries: list[tuple[int, tuple, dict]], directories) -> list[list[str]]:
    """For rows of several runs (``(run index, row key, method config)``), the tags that tell apart rows two runs
    would otherwise share (a table keeps one cell per key): the method options that matter to them and differ, else
    what differs in the runs' setups (model, benchmark, context, protocol), else the run directory. ``[]`` for a row
    no other run shares. ``ValueError`` (one line) when nothing tells them apart (one run given twice)."""
    from spark_bench.methods.pipeline import relevant_options
    from spark_bench.report.setup import run_setup

    members: dict = {}
    for n, (run, key, _) in enumerate(entries):
        members.setdefault(key, []).append(n)
    tags: list[list[str]] = [[] for _ in entries]
    setups: dict = {}
    for key, rows in members.items():
        if len({entries[n][0] for n in rows}) < 2:
            continue
        methods = [entries[n][2] for n in rows]
        options = [k for k in methods[0] if k in relevant_options(methods[0])
                   and len({repr(m.get(k)) for m in methods}) > 1]
        for n in rows:
            run = entries[n][0]
            setups.setdefault(run, run_setup(directories[run]) or {})
        fields = [f for f in ("model", "benchmark", "context", "protocol")
                  if len({repr(setups[entries[n][0]].get(f)) for n in rows}) > 1]
        for n in rows:
            method, setup = entries[n][2], setups[entries[n][0]]
            tags[n] = [f"{k}={_text(method.get(k))}" for k in options] + [f"{f}={setup.get(f)}" for f in fields]
        if not options and not fields:
            names = [Path(directories[entries[n][0]]).name for n in rows]
            if len(set(names)) < len(names):
                names = [str(directories[entries[n][0]]) for n in rows]
            if len(set(names)) < len(names):
                raise ValueError(f"{names[0]} is given more than once (its row {' / '.join(map(str, key))} would "
                                 f"be shown once); give each run once")
            for n, name in zip(rows, names):
                tags[n] = [f"run={name}"]
    return tags


def _text(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


def runs_config_rows(directories, loaded: list[pd.DataFrame]) -> list[list[tuple[pd.DataFrame, str, str, str]]]:
    """:func:`config_rows` of each run (``loaded``: their predictions), rows that two runs share told apart
    (:func:`run_tags`)."""
    rows = [(i, *row) for i, preds in enumerate(loaded) for row in config_rows(preds)]
    tags = run_tags([(i, (block, base, method), group.iloc[0]["method"]) for i, group, block, base, method in rows],
                    directories)
    out: list[list] = [[] for _ in loaded]
    for (i, group, block, base, method), tag in zip(rows, tags):
        out[i].append((group, block, base, with_tags(method, tag)))
    return out


def _load(directory) -> pd.DataFrame:
    from spark_bench.report.kvpress_read import is_kvpress, read_kvpress

    if is_kvpress(directory):  # a kvpress evaluation output read as a run
        return read_kvpress(directory)
    path = Path(directory) / "predictions.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{directory}: no predictions.jsonl (not a spark-bench results directory)")
    return pd.DataFrame(parse_records(path, path.read_bytes()))


def ablation_cell(m: dict, kind: str) -> tuple[str, str, str] | None:
    """(block, row label, column) of a method config in an ablation layout — ``dist`` (rows Normal / Exponential /
    Degenerate per ratio) or ``variants`` (SparK / SparK-p / SparK-g rows) — or None if it has no cell there."""
    if "+spark" not in m["name"]:
        return None
    column = budget_block(m["budget"])
    if kind == "dist":
        if m.get("variant", "fixed") != "fixed":
            return None
        return f"ratio {m['ratio']:g}", RECOVERY_NAMES.get(m["recovery"], m["recovery"]), column
    if m["variant"] == "top_p":
        label = f"SparK-p (p={100 * m['top_p']:g}%)"
    elif m["variant"] == "group":
        label = f"SparK-g (g={m['groups']})"
    elif m["variant"] == "group_fork":
        label = "SparK-g (official code)"
    else:
        label = f"SparK (ratio {m['ratio']:g})"
    return f"{DISPLAY[m['name'].split('+')[0]]} LongBench avg", label, column  # the paper block


def read_ablation(directories, kind: str) -> pd.DataFrame:
    """Runs in the ablation layouts: ``dist`` (rows Normal/Exponential/Degenerate per ratio) or ``variants``
    (SparK / SparK-p / SparK-g rows with the achieved ``Overall ratio``); each cell the mean over tasks."""
    cells = []
    for run, directory in enumerate(directories):
        preds = _load(directory)
        for _, group in preds.groupby("config", sort=False):
            cell = ablation_cell(group.iloc[0]["method"], kind)
            if cell is not None:
                cells.append((run, cell, group))
    tags = run_tags([(run, (block, label, column), group.iloc[0]["method"]) for run, (block, label, column), group
                     in cells], directories)
    rows = []
    for (_, (block, label, column), group), tag in zip(cells, tags):
        label = with_tags(label, tag)
        avg = group.groupby("task").score.mean().mean()
        rows.append((block, "", label, column, avg))
        if kind != "dist":
            rows.append((block, "", label, "Overall ratio", group.key_ratio.mean()))
    frame = pd.DataFrame(rows, columns=COLUMNS)
    # the overall ratio is one number per variant: its mean over budgets
    ratio = frame.column == "Overall ratio"
    merged = frame[ratio].groupby(["block", "group", "method", "column"], sort=False).value.mean().reset_index()
    return pd.concat([frame[~ratio], merged], ignore_index=True)[COLUMNS]


def expected(directory) -> dict | None:
    """What a run set out to compute (its manifest's ``expected``: ``samples`` as ``[id, task]`` pairs and config
    ``configs`` labels), or None where the manifest does not say (runs written before it did, merged shards)."""
    path = Path(directory) / "manifest.json"
    if not path.exists():
        return None
    return read_manifest(path).get("expected")


def completeness(directory, preds: pd.DataFrame | None = None) -> str | None:
    """``"N of M predictions (K samples, L configs missing)"`` for a run that has not finished; None when every
    expected prediction is there (or the run does not say what it expected)."""
    plan = expected(directory)
    if plan is None:
        return None
    preds = _load(directory) if preds is None else preds
    done = set(zip(preds.id, preds.config))
    wanted = [(i, c) for i, _ in plan["samples"] for c in plan["configs"]]
    missing = [(i, c) for i, c in wanted if (i, c) not in done]
    if not missing:
        return None
    samples, configs = {i for i, _ in missing}, {c for _, c in missing}
    return (f"{len(wanted) - len(missing)} of {len(wanted)} predictions ({len(samples)} of {len(plan['samples'])} "
            f"samples, {len(configs)} of {len(plan['configs'])} configs missing some)")


def read_runs(directories, layout: Layout) -> pd.DataFrame:
    """Mean score per (config, task) of every run directory, in the long format, plus ``KV %``, ``Key ratio`` and,
    where measured, the fidelity columns ``NLL`` / ``KL full`` / ``Agree`` (means over tasks);
    ``n`` samples per cell, ``partial`` where a stopped run lacks some of the cell's expected samples."""
    if layout.name in ("dist", "variants"):
        return read_ablation(directories, layout.name)
    rows = []
    loaded = [_load(directory) for directory in directories]
    for directory, told in zip(directories, runs_config_rows(directories, loaded)):
        plan = expected(directory)
        per_task = pd.Series([t for _, t in plan["samples"]]).value_counts().to_dict() if plan else {}
        for group, block, base, method in told:
            short = False
            for task, scores in group.groupby("task", sort=False):
                column = (layout.task_names or {}).get(task, task)
                partial = len(scores) < per_task.get(task, 0)
                short |= partial
                rows.append((block, base, method, column, scores.score.mean(), len(scores), partial))
            for column, value in (("KV %", 100 * (group.kv_bytes / group.kv_bytes_full).mean()),
                                  ("Key ratio", group.key_ratio.mean())):
                rows.append((block, base, method, column, value, len(group), short))
            for field, column in FIDELITY_COLUMNS.items():  # the mean over tasks of each task's mean, as Avg.
                values = pd.to_numeric(group[field], errors="coerce") if field in group else None
                if values is not None and values.notna().any():
                    rows.append((block, base, method, column, values.groupby(group.task).mean().mean(),
                                 int(values.notna().sum()), short))
    return pd.DataFrame(rows, columns=[*COLUMNS, "n", "partial"])


SAMPLE_COLUMNS = ["block", "group", "method", "column", "id", "score", "kv_bytes", "kv_bytes_full", "key_ratio",
                  "length"]


def read_sample_scores(directories, layout: Layout) -> pd.DataFrame:
    """One row per (method config, sample) of every run: the rows and columns of the layout, plus the sample id,
    its score, the KV bytes held, the LongBench length (words; None for RULER) and the fidelity numbers
    (``answer_nll``, ``kl_full``, ``agree_full``; NaN where a run did not measure them). The statistics of
    :mod:`spark_bench.report.stats` resample these."""
    frames = []
    loaded = [_load(directory) for directory in directories]
    for told in runs_config_rows(directories, loaded):
        for group, block, base, method in told:
            frames.append(pd.DataFrame({
                "block": block, "group": base, "method": method,
                "column": group.task.map(lambda t: (layout.task_names or {}).get(t, t)), "id": group.id,
                "score": group.score, "kv_bytes": group.kv_bytes, "kv_bytes_full": group.kv_bytes_full,
                "key_ratio": group.key_ratio, "length": group["length"] if "length" in group else None,
                **{f: pd.to_numeric(group[f], errors="coerce") if f in group else float("nan")
                   for f in FIDELITY}}))
    if not frames:
        raise ValueError(f"no predictions in {', '.join(map(str, directories))}")
    return pd.concat(frames, ignore_index=True)[[*SAMPLE_COLUMNS, *FIDELITY]]
