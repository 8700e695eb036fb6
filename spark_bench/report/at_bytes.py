"""Methods side by side at equal KV bytes (``spark-bench-report --at-bytes``), and the points its figures draw.

At the same nominal ratio two methods hold different bytes (masks, sign bits, statistics, a dense window), so the
comparison a reader needs is at **matched bytes**. Every config's byte fraction is measured: the mean over its
samples of ``kv_bytes / kv_bytes_full`` (what its compressed cache really holds over the full cache, the table's
``KV %``). Its score, ``answer_nll`` and ``kl_full`` are the means over tasks of each task's mean, with the seeded,
stratified 95% bootstrap interval of :mod:`spark_bench.report.stats` (the table's ``Avg.`` and fidelity columns).

**Method families** (:func:`families`): the configs of one method that differ only in how much they keep —
``snapkv+spark`` at λ 0.5 / 0.7 / 0.8 is one family, ``snapkv+think`` another, ``spark`` alone another, SnapKV
alone across its budgets another. A family is one method name with every option that matters to it
(:func:`~spark_bench.methods.config.relevant_options`) equal, except ``ratio`` and ``budget``. When the configs of a
family vary in ``ratio`` its curve runs along λ, one family per budget (``SnapKV+SparK @0.5``); otherwise along its
budget. Families of one name that differ in another option carry it in their label (``[recovery=none]``), and
families of different runs that would share a label carry the run's tag, as the tables do.

**The rule at a common byte fraction x** (:func:`interpolate`): a family's configs are sorted by byte fraction;
at a config's own fraction its own numbers are taken; strictly between the two nearest configs ``a`` and ``b``
(``f_a < x < f_b``) each number is linear in the byte fraction, ``y = y_a + (x - f_a) / (f_b - f_a) · (y_b - y_a)``,
and so is each endpoint of its 95% interval (``low`` from ``low_a`` and ``low_b``, ``high`` likewise). For two
independent estimates this interval is at least as wide as the interpolated estimate's own (the standard deviation
of ``w·A + (1-w)·B`` is at most ``w·σ_A + (1-w)·σ_B``): conservative, never narrower. Outside ``[f_min, f_max]``
of the family the cell is left empty and a note gives the family's measured range: **never extrapolated**.
Configs of one family at the same byte fraction (within 1e-9) are averaged into one point.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd

from spark_bench.methods.channel.leank import label_ratio
from spark_bench.methods.config import display, relevant_options, tell_apart
from spark_bench.report import stats

METRICS = {"score": "Score", "kl_full": "KL full", "answer_nll": "NLL"}  # what the view interpolates
SENSE = {"score": "higher is better", "kl_full": "lower stays closer to the full cache",
         "answer_nll": "lower keeps the reference answer likelier"}
DEFAULT_FRACTIONS = tuple(round(0.1 * i, 1) for i in range(1, 11))  # 10%, 20%, …, 100% of the full cache's bytes
KNOBS = ("ratio", "budget")


def _family_label(method: dict) -> str:
    """``SnapKV+SparK``, ``SparK``, ``SnapKV``, ``Full``: the method's display name, without its knobs."""
    return "+".join(display(part) for part in str(method.get("name", "full")).split("+"))


def _options(method: dict) -> dict:
    """The options that matter to the method, without its knobs (``ratio``, ``budget``; LeanK's mask file, whose
    pruned fraction is its λ)."""
    keep = relevant_options(method) - set(KNOBS)
    out = {k: method.get(k) for k in sorted(keep) if k in method}
    if isinstance(out.get("leank"), dict):
        out["leank"] = {k: v for k, v in out["leank"].items() if k != "mask"}
    return out


def knob_ratio(method: dict):
    """The λ a config's curve runs along: its ``ratio``, or the pruned fraction of LeanK's mask file (the file's
    name where it cannot be read here)."""
    if not isinstance(method, dict):
        return None
    mask = (method.get("leank") or {}).get("mask") if isinstance(method.get("leank"), dict) else None
    if mask and str(method.get("name", "")).split("+")[-1] == "leank":
        text = label_ratio({"mask": mask})
        return float(text) if text != "?" else str(mask)
    return method.get("ratio")


def families(preds: pd.DataFrame) -> pd.DataFrame:
    """One row per config of the runs' predictions (:func:`~spark_bench.report.figures.load_predictions`):
    ``run, config, family, knob, point`` — its family's label, the knob its curve runs along (``ratio`` or
    ``budget``), and the point's own label on that curve (``λ 0.8``, ``@0.5``)."""
    firsts = preds.drop_duplicates(["run", "config"])
    rows = []
    for run, config, method in zip(firsts.run, firsts.config, firsts.method):
        key = json.dumps([int(run), method.get("name"), _options(method)], sort_keys=True, default=str)
        rows.append({"run": run, "config": config, "method": method, "key": key})
    frame = pd.DataFrame(rows)
    knob, label = {}, {}
    for key, part in frame.groupby("key", sort=False):
        ratios = {repr(knob_ratio(m)) for m in part.method}
        knob[key] = "ratio" if len(ratios) > 1 else "budget"
    keys = []
    for key, method in zip(frame.key, frame.method):
        name = _family_label(method)
        if knob[key] == "ratio" and "budget" in relevant_options(method):
            name += f" @{method.get('budget'):g}"
            key = f"{key}\t{method.get('budget')!r}"
        label[key] = name
        keys.append(key)
    frame["key"] = keys
    # families of one label that differ in another option (or another run) carry it, as rows in a table do
    unique = list(dict.fromkeys(frame.key))
    bare = [{o: v for o, v in frame[frame.key == k].method.iloc[0].items() if o not in KNOBS} for k in unique]
    told = tell_apart([label[k] for k in unique], bare)
    runs = [int(frame[frame.key == k].run.iloc[0]) for k in unique]
    for i, (k, text) in enumerate(zip(unique, told)):
        if sum(t == text for t in told) > 1 and len({runs[j] for j, t in enumerate(told) if t == text}) > 1:
            text = f"{text} [run {runs[i] + 1}]"
        label[k] = text
    frame["family"] = [label[k] for k in frame.key]
    frame["knob"] = [knob[k.split("\t")[0]] for k in frame.key]
    frame["point"] = [_point(m, kb) for m, kb in zip(frame.method, frame.knob)]
    return frame[["run", "config", "family", "knob", "point"]]


def _point(method: dict, knob: str) -> str:
    """A config's label on its family's curve: ``λ 0.8`` along the ratio, ``@0.5`` along the budget."""
    if knob == "ratio":
        lam = knob_ratio(method)
        return f"λ {lam}" if isinstance(lam, str) else f"λ {lam or 0:g}"
    return f"@{method.get('budget'):g}" if "budget" in relevant_options(method) else _family_label(method)


def _average(values: pd.DataFrame, column: str, resamples: int, seed: int) -> stats.Interval | None:
    """The mean over tasks of ``column`` with its stratified interval, or None where some sample lacks it."""
    tasks = [g.sort_values("id")[column].to_numpy(float) for _, g in values.groupby("task", sort=False)]
    if not tasks or any(np.isnan(t).any() for t in tasks):
        return None
    _, average = stats.mean_intervals(tasks, resamples, seed)
    return average


def points(preds: pd.DataFrame, resamples: int = stats.RESAMPLES, seed: int = stats.SEED) -> pd.DataFrame:
    """One row per config: ``run, config, family, knob, point, fraction`` (the measured byte fraction; NaN where
    the run did not measure bytes, e.g. a kvpress result) and, per metric of :data:`METRICS`, ``<metric>``,
    ``<metric>_low``, ``<metric>_high`` (NaN where not measured)."""
    preds = preds.assign(**{m: pd.to_numeric(preds[m], errors="coerce") if m in preds else float("nan")
                            for m in METRICS})
    named = families(preds).set_index(["run", "config"])
    out = []
    for (run, config), group in preds.groupby(["run", "config"], sort=False):
        ratio = pd.to_numeric(group.kv_bytes, errors="coerce") / pd.to_numeric(group.kv_bytes_full, errors="coerce")
        row = {"run": run, "config": config, **named.loc[(run, config)].to_dict(), "fraction": float(ratio.mean())}
        for metric in METRICS:
            found = _average(group, metric, resamples, seed)
            row.update({metric: found.estimate if found else math.nan, f"{metric}_low": found.low if found else
                        math.nan, f"{metric}_high": found.high if found else math.nan})
        out.append(row)
    return pd.DataFrame(out)


def interpolate(curve: pd.DataFrame, x: float, metric: str) -> tuple[float, float, float] | None:
    """``(estimate, low, high)`` of ``metric`` at byte fraction ``x`` on one family's ``curve`` (its
    :func:`points` rows), by the module's rule; None outside the family's measured range (never extrapolated) or
    where the metric was not measured at the configs that bracket ``x``."""
    curve = curve.dropna(subset=["fraction", metric])
    if curve.empty:
        return None
    columns = [metric, f"{metric}_low", f"{metric}_high"]
    merged = curve.assign(f=curve.fraction.round(9)).groupby("f")[columns].mean().sort_index()
    f = merged.index.to_numpy(float)
    if x < f[0] - 1e-9 or x > f[-1] + 1e-9:
        return None
    near = np.isclose(f, x, rtol=0, atol=1e-9)
    if near.any():
        return tuple(float(v) for v in merged[columns].to_numpy()[near.argmax()])
    b = int(np.searchsorted(f, x))
    a = b - 1
    w = (x - f[a]) / (f[b] - f[a])
    ya, yb = merged[columns].to_numpy()[a], merged[columns].to_numpy()[b]
    return tuple(float(v) for v in ya + w * (yb - ya))


def at_bytes(pts: pd.DataFrame, fractions=DEFAULT_FRACTIONS) -> pd.DataFrame:
    """Long frame ``metric, fraction, family, value, low, high, note``: each family's numbers interpolated at each
    common byte fraction; ``value`` NaN and ``note`` ``outside`` where ``fraction`` is outside the family's range,
    ``not measured`` where the metric was not. Fractions no family reaches are dropped."""
    out = []
    for metric in METRICS:
        for x in fractions:
            for family, curve in pts.groupby("family", sort=False):
                found = interpolate(curve, x, metric)
                measured = curve[metric].notna().any() and curve.fraction.notna().any()
                note = "" if found else ("outside" if measured else "not measured")
                value, low, high = found if found else (math.nan, math.nan, math.nan)
                out.append((metric, x, family, value, low, high, note))
    frame = pd.DataFrame(out, columns=["metric", "fraction", "family", "value", "low", "high", "note"])
    reached = frame[frame.value.notna()].fraction.unique()
    return frame[frame.fraction.isin(reached)].reset_index(drop=True)


def ranges(pts: pd.DataFrame) -> dict[str, tuple[float, float]]:
    """Each family's measured byte-fraction range (families without measured bytes left out)."""
    known = pts.dropna(subset=["fraction"])
    return {f: (float(c.fraction.min()), float(c.fraction.max())) for f, c in known.groupby("family", sort=False)}


def to_markdown(table: pd.DataFrame, pts: pd.DataFrame) -> str:
    """One table per metric: rows the common byte fractions, columns the families; cells ``estimate [low,
    high]``, ``–`` outside a family's measured range; then the rule and each family's range."""
    unmeasured = [f for f in dict.fromkeys(pts.family) if f not in ranges(pts)]
    without = f"Without measured bytes (left empty): {', '.join(unmeasured)}." if unmeasured else ""
    if table.empty:
        return ("No common byte fraction lies within any family's measured range (or no config measured its "
                "bytes).\n" + (f"\n{without}\n" if without else ""))
    filled = set(table[table.value.notna()].family)  # a family empty at every fraction: no column (noted below)
    families_ = [f for f in dict.fromkeys(table.family) if f in filled]
    parts = []
    for metric, part in table.groupby("metric", sort=False):
        if part.value.isna().all():
            continue
        digits = 2 if metric == "score" else 3
        lines = [f"{METRICS[metric]} at equal KV bytes (mean over tasks, 95% interval; {SENSE[metric]}):", "",
                 "| KV bytes | " + " | ".join(families_) + " |", "|---" * (len(families_) + 1) + "|"]
        for x, row in part.groupby("fraction", sort=True):
            cells = []
            for family in families_:
                hit = row[row.family == family].iloc[0]
                cells.append("–" if math.isnan(hit.value) else
                             f"{hit.value:.{digits}f} [{hit.low:.{digits}f}, {hit.high:.{digits}f}]")
            lines.append(f"| {100 * x:g}% | " + " | ".join(cells) + " |")
        parts.append("\n".join(lines) + "\n")
    span = ranges(pts)
    measured = "; ".join(f"{f} {100 * lo:.1f}–{100 * hi:.1f}%" for f, (lo, hi) in span.items())
    notes = ["KV bytes: what the compressed cache holds over the full cache's bytes (measured per sample, the "
             "table's KV %). Each family's numbers are interpolated linearly in the byte fraction between its two "
             "nearest configs, the interval's endpoints likewise (at least as wide as the interpolated estimate's "
             "own); at a config's own fraction its own numbers. – : outside the family's measured range, never "
             f"extrapolated. Measured ranges: {measured}."]
    if without:
        notes.append(without)
    return "\n".join(parts) + "\n" + "\n\n".join(notes) + "\n"


def parse_fractions(text: str | None) -> tuple[float, ...]:
    """``--at-bytes`` values: fractions or percentages, comma separated (``0.3,0.5`` or ``30%,50%``); '' or None:
    :data:`DEFAULT_FRACTIONS`. ``ValueError`` (one line) for anything else."""
    if not text:
        return DEFAULT_FRACTIONS
    out = []
    for item in text.split(","):
        item = item.strip()
        try:
            value = float(item[:-1]) / 100 if item.endswith("%") else float(item)
        except ValueError:
            value = math.nan
        if not 0 < value <= 1:
            raise ValueError(f"--at-bytes: {item!r} is not a byte fraction; give fractions in (0, 1] or "
                             "percentages, comma separated (e.g. --at-bytes 0.3,0.5 or 30%,50%)")
        out.append(value)
    return tuple(sorted(set(out)))
