"""``spark-bench-export --format kvpress RUN --out DIR`` is ``spark-bench-export-kvpress RUN --out DIR``, taken off
the command line before Hydra sees it; another ``--format`` is one line naming the valid ones, exit 2; without
``--format`` the command stays the Hydra sample exporter."""

from __future__ import annotations

import sys

import pytest

import spark_bench.tools as tools


def _refused(monkeypatch, capsys, *argv: str) -> str:
    monkeypatch.setattr(sys, "argv", ["spark-bench-export", *argv])
    with pytest.raises(SystemExit) as stop:
        tools.export()
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1, err
    return err[0]


def test_another_format_is_refused_in_one_line(monkeypatch, capsys):
    valid = "valid: kvpress (or no --format: the benchmark's samples, from key=value overrides)"
    assert _refused(monkeypatch, capsys, "run", "--format", "csv") == \
        f"spark-bench-export: error: --format 'csv': no such export format; {valid}"
    for flag in ("--format=", "--format"):
        assert _refused(monkeypatch, capsys, flag) == f"spark-bench-export: error: --format '': needs a value; {valid}"


def test_format_kvpress_is_the_kvpress_exporter(monkeypatch, capsys, tmp_path):
    out = tmp_path / "out"
    for flag in (["--format", "kvpress"], ["--format=kvpress"]):
        line = _refused(monkeypatch, capsys, *flag, str(tmp_path / "nowhere"), "--out", str(out))
        assert line == (f"spark-bench-export --format kvpress: error: {tmp_path / 'nowhere'}: no predictions.jsonl "
                        "(not a spark-bench results directory)")
        assert not out.exists()
    assert _refused(monkeypatch, capsys, "--format", "kvpress", str(tmp_path)).startswith(
        "spark-bench-export --format kvpress: error: the following arguments are required: --out")


def test_without_format_it_is_the_hydra_exporter(monkeypatch):
    seen = []
    monkeypatch.setattr(tools, "checked", lambda tool, entry: seen.append((tool, entry)))
    monkeypatch.setattr(sys, "argv", ["spark-bench-export", "model=tiny", "export_path=s.jsonl"])
    tools.export()
    assert seen == [("spark-bench-export", tools._hydra_export)]
