"""kvpress' evaluation format both ways (issue 54 item 5): a tiny run exported as kvpress' ``evaluation/evaluate.py``
writes it, read by kvpress' reading logic (re-implemented here from their code, independently of ours) and by
``spark-bench-report``; a kvpress output directory, written as their code writes it, reported beside a run; every
bad input refused in one line, exit 2, nothing written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from spark_bench.report import kvpress_format  # writing (and the command)
from spark_bench.report import kvpress_read as reader  # reading, and the names and list codec both share
from spark_bench.report import main as report_main
from spark_bench.report.frame import read_runs
from spark_bench.report.layouts import RULER

MODEL = "org/tiny-llama"

# ----- kvpress' side, from NVIDIA/kvpress evaluation/evaluate.py and evaluation/benchmarks/ruler/calculate_metrics.py

KVPRESS_CONFIG_FIELDS = ["dataset", "data_dir", "model", "device", "press_name", "compression_ratio",
                         "key_channel_compression_ratio", "head_compression_ratio", "threshold", "fraction",
                         "max_new_tokens", "max_context_length", "query_aware", "needle_depth",
                         "compression_interval", "target_size", "hidden_states_buffer_size", "output_dir",
                         "log_level", "model_kwargs", "press_init_command", "seed", "fp8"]


def kvpress_dir_name(c: dict) -> str:
    """``EvaluationConfig.get_results_dir`` (evaluate.py), the numbering aside."""
    parts = [c["dataset"], str(c["data_dir"]) if c["data_dir"] else "", c["model"].replace("/", "--"),
             c["press_name"], f"{c['compression_ratio']:.2f}"]
    if c.get("query_aware"):
        parts.append("query_aware")
    if c.get("key_channel_compression_ratio") is not None:
        parts.append(f"key_channel_cr{c['key_channel_compression_ratio']:.2f}")
    return "__".join(filter(None, parts))


def kvpress_ruler_metrics(df: pd.DataFrame) -> dict:
    """``benchmarks/ruler/calculate_metrics.py``'s ``calculate_metrics``, as their code computes it."""
    def string_match_part(preds, refs):
        return round(sum(max(1.0 if r.lower() in p.lower() else 0.0 for r in ref) for p, ref in zip(preds, refs))
                     / len(preds) * 100, 2)

    def string_match_all(preds, refs):
        return round(sum(sum(1.0 if r.lower() in p.lower() else 0.0 for r in ref) / len(ref)
                         for p, ref in zip(preds, refs)) / len(preds) * 100, 2)

    pattern = re.compile(r"[\x00-\x1f]")
    df["predicted_answer"] = df["predicted_answer"].apply(lambda x: pattern.sub("", x.strip()).strip())
    scores = {}
    for task, part in df.groupby("task"):
        fn = string_match_part if task.split("_")[0] == "qa" else string_match_all
        scores[task] = {"string_match": fn(part["predicted_answer"].tolist(), part["answer"].tolist())}
    return scores


def kvpress_read(output_dir: Path) -> dict[str, tuple[dict, pd.DataFrame, dict]]:
    """What kvpress' tooling reads of an output directory: the finished evaluations (``run_evaluation``: both
    ``predictions.csv`` and ``metrics.json``), each config a mapping of ``EvaluationConfig``'s fields (its CLI builds
    ``EvaluationConfig(**yaml)``: an unknown key is a TypeError), its predictions and metrics."""
    out = {}
    for metrics in sorted(output_dir.rglob("metrics.json")):
        place = metrics.parent
        if not (place / "predictions.csv").exists():
            continue
        config = yaml.safe_load((place / "config.yaml").read_text())
        assert set(config) <= set(KVPRESS_CONFIG_FIELDS), set(config) - set(KVPRESS_CONFIG_FIELDS)
        df = pd.read_csv(place / "predictions.csv", keep_default_na=False)
        out[place.name] = (config, df, json.loads(metrics.read_text()))
    return out


def numpy_list(text: str) -> list[str]:
    """A list cell of their CSV (``str()`` of a numpy object array) back to its strings."""
    return [eval(s) for s in re.findall(r"'(?:[^'\\]|\\.)*'", text)]  # noqa: S307 — test data we wrote


# ----------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def run(tiny_lm, tmp_path_factory):
    from spark_bench.benchmarks.ruler import load_ruler
    from spark_bench.methods import MethodConfig
    from spark_bench.runner import run_sweep

    samples = load_ruler(["niah_single_1", "niah_multikey_1"], 512, 2, 7, tiny_lm, max_new_tokens=4)
    configs = [MethodConfig(name="full"), MethodConfig(name="snapkv", budget=0.5),
               MethodConfig(name="snapkv+spark", budget=0.5, ratio=0.8)]
    out = tmp_path_factory.mktemp("kvpress_run")
    run_sweep(tiny_lm, samples, configs, out)
    return out


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("kvpress_export") / "results"
    kvpress_format.main([str(run), "--out", str(out), "--data-dir", "512", "--model", MODEL, "-q"])
    return out


def kvpress_output(root: Path) -> Path:
    """A kvpress output directory as ``evaluate.py`` writes it (two evaluations, the second one twice: numbered)."""
    rows = [("niah_single_1", ["1234"], " 1234."), ("niah_single_1", ["77"], " no."),
            ("niah_multikey_1", ["a b", "it's"], "A B and it's"), ("niah_multikey_1", ["5"], "5")]
    for press, ratio in (("no_press", 0.0), ("snapkv", 0.5)):
        config = {**{k: None for k in KVPRESS_CONFIG_FIELDS}, "dataset": "ruler", "data_dir": "512",
                  "model": MODEL, "press_name": press, "compression_ratio": ratio, "fraction": 1.0,
                  "query_aware": True, "output_dir": str(root), "log_level": "INFO", "model_kwargs": {},
                  "press_init_command": f"{press}()", "seed": 42, "fp8": False}
        config.pop("threshold"), config.pop("head_compression_ratio")  # save_config drops them when unset
        place = root / kvpress_dir_name(config)
        place.mkdir(parents=True)
        df = pd.DataFrame({"context": "ctx", "question": "q?", "answer_prefix": "Answer:",
                           "answer": [np.array(a, dtype=object) for _, a, _ in rows], "task": [t for t, _, _ in rows],
                           "max_new_tokens": 128, "predicted_answer": [p for _, _, p in rows],
                           "compression_ratio": ratio})
        df[list(set(df.columns) - {"context"})].to_csv(place / "predictions.csv", index=False)  # _save_results
        scored = df.assign(answer=df.answer.map(list))
        (place / "metrics.json").write_text(json.dumps(kvpress_ruler_metrics(scored), indent=4))
        with open(place / "config.yaml", "w") as f:
            yaml.dump(config, f, default_flow_style=False, indent=2, sort_keys=False)
    return root


# -------------------------------------------------------------------------------------------------------- tests


def test_lists_are_written_and_read_as_kvpress_csv_holds_them():
    values = ["plain", "it's \"quoted\"", "x" * 90, "back\\slash"]
    text = reader.array_text(values)
    assert text == str(np.array(values, dtype=object)) and "\n" in text  # numpy wraps long arrays
    assert reader.parse_array_text(text) == values
    assert reader.parse_array_text("['a', 'b']") == ["a", "b"] and reader.parse_array_text("") == []


def test_export_is_kvpress_layout_and_their_reading_finds_our_numbers(run, exported):
    read = kvpress_read(exported)
    assert sorted(read) == [f"ruler__512__org--tiny-llama__{name}" for name in (
        "no_press__0.00__query_aware", "snapkv+spark__0.50__query_aware__key_channel_cr0.80",
        "snapkv__0.50__query_aware")]
    table = read_runs([run], RULER)
    for name, (config, df, metrics) in read.items():
        assert kvpress_dir_name(config) == name
        assert list(config) == [k for k in KVPRESS_CONFIG_FIELDS if k not in ("threshold", "head_compression_ratio")]
        assert list(df.columns[:7]) == ["question", "answer_prefix", "answer", "task", "max_new_tokens",
                                        "predicted_answer", "compression_ratio"]
        scored = df.assign(answer=df.answer.map(numpy_list))
        assert kvpress_ruler_metrics(scored) == metrics  # their scorer on our predictions gives our metrics.json
        label = json.loads((exported / name / "spark_bench.json").read_text())["config"]
        ours = table[(table.method == {"Full": "Vanilla", "SnapKV @0.5": "SnapKV"}.get(label, "+SparK (0.8)"))]
        average = sum(v["string_match"] for v in metrics.values()) / len(metrics)  # as their average_score.py
        assert average == pytest.approx(ours[ours.column.isin(["Niah1", "MKey1"])].value.mean(), abs=0.01)
    assert reader.evaluations(exported) == sorted(exported / n for n in read)


def test_the_report_reads_an_export_as_the_run_it_came_from(run, exported):
    ours, back = read_runs([run], RULER), read_runs([exported], RULER)
    key = ["block", "group", "method", "column"]
    merged = ours.merge(back, on=key, suffixes=("", "_back"))
    assert len(merged) == len(ours) == len(back)
    assert np.allclose(merged.value, merged.value_back)  # scores, KV %, key ratio and the fidelity numbers
    sessions = reader.sessions(exported)
    assert sessions and sessions[0]["spark_bench"]  # the run's provenance travels with the export


def test_a_kvpress_output_is_reported_beside_a_run(run, tmp_path, capsys):
    kv = kvpress_output(tmp_path / "kvpress_results")
    back = reader.read_kvpress(kv)
    assert set(back.config) == {"kvpress no_press @0.00", "kvpress snapkv @0.50"}
    means = back.groupby(["config", "task"]).score.mean()
    assert set(means[:, "niah_single_1"]) == {50.0} and set(means[:, "niah_multikey_1"]) == {100.0}
    out = tmp_path / "rep"
    report_main([str(run), str(kv), "--layout", "ruler", "--out", str(out), "--at-bytes"])
    md = (out / "table.md").read_text()
    assert f"{kv}: a kvpress evaluation output (kvpress evaluate.py's config.yaml: model {MODEL}" in md
    assert "press_name no_press, snapkv" in md and f"{run}: made by spark-bench" in md
    assert "the runs' provenance differs" not in md  # kvpress records none: its own note says so
    rows = {line.split(" | ")[0]: line for line in md.splitlines() if line.startswith("| SnapKV [")}
    ours, theirs = (next(line for key, line in rows.items() if tag in key) for tag in ("model=tiny-llama",
                                                                                        f"model={MODEL}"))
    assert "protocol=kvpress" in theirs and "| 50.00 | 100.00 | 75.00 | – | – | – | – | 0.00 |" in theirs
    assert ours.count(" – ") == 0  # the run's row: bytes and fidelity measured
    cost = (out / "cost.md").read_text()
    assert "SnapKV @0.5 |" in cost and "kvpress" not in cost  # kvpress records no cost
    at = (out / "at_bytes.md").read_text()
    assert "Without measured bytes (left empty): Full [compress_scope=question], SnapKV [compress_scope=question]." \
        in at


def test_kvpress_knows_the_presses_the_export_names():
    """Where kvpress is installed (``make test-compat``): every press name the export maps to is a press of its."""
    kvpress = pytest.importorskip("kvpress")
    classes = {"no_press": None, "snapkv": "SnapKVPress", "streaming_llm": "StreamingLLMPress",
               "pyramidkv": "PyramidKVPress", "adakv_snapkv": "AdaKVPress", "tova": "TOVAPress", "think": "ThinKPress",
               "snap_think": "ComposedPress"}
    assert set(classes) == set(reader.PRESS_NAMES.values())
    for cls in filter(None, classes.values()):
        assert hasattr(kvpress, cls), cls


def _refused(capsys, argv, out: Path) -> str:
    with pytest.raises(SystemExit) as stop:
        kvpress_format.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1, err
    assert not out.exists()
    return err[0]


def test_every_bad_input_is_refused_in_one_line(run, tmp_path, capsys):
    out = tmp_path / "out"
    assert "no predictions.jsonl (not a spark-bench results directory)" in _refused(
        capsys, [str(tmp_path / "nowhere"), "--out", str(out)], out)
    assert "give --data-dir" in _refused(capsys, [str(run), "--out", str(out)], out)  # a library run: no length
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "predictions.jsonl").write_text((run / "predictions.jsonl").read_text().splitlines()[0][:-9] + "\n")
    assert f"{damaged / 'predictions.jsonl'}:1:" in _refused(capsys, [str(damaged), "--out", str(out)], out)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    line = _refused(capsys, [str(run), "--out", str(blocker / "sub"), "--data-dir", "512"], blocker / "sub")
    assert line == (f"spark-bench-export-kvpress: error: --out: {blocker} is a file, not a directory; choose "
                    "another --out=")
    assert "--out" in _refused(capsys, [str(run)], out)  # required


def test_a_damaged_kvpress_output_is_one_line_in_the_report(tmp_path, capsys):
    kv = kvpress_output(tmp_path / "kv")
    place = reader.evaluations(kv)[0]
    (place / "config.yaml").write_text("dataset: [unclosed\n")
    with pytest.raises(SystemExit) as stop:
        report_main([str(kv), "--out", str(tmp_path / "rep")])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and f"{place}: not a readable kvpress evaluation" in err[0], err
    assert not (tmp_path / "rep").exists()
