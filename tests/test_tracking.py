"""Experiment tracking with the real libraries, offline: MLflow's local file store and W&B's offline mode; what
was logged is read back and equals the run's own scores and cost."""

import struct

import pandas as pd
import pytest
from spark_bench import tracking

pytest.importorskip("mlflow")
pytest.importorskip("wandb")


@pytest.fixture(scope="module")
def finished_run(tiny_lm, tmp_path_factory):
    from spark_bench.benchmarks.ruler import load_ruler
    from spark_bench.methods import MethodConfig
    from spark_bench.runner import run_sweep

    root = tmp_path_factory.mktemp("tracked")
    samples = load_ruler(["niah_single_1"], 512, 2, 0, tiny_lm, max_new_tokens=3)
    run_sweep(tiny_lm, samples, [MethodConfig(name="full"), MethodConfig(name="snapkv+spark", budget=64, ratio=0.8)],
              root / "run", progress=False)
    return root, tracking.metrics(pd.read_csv(root / "run" / "scores.csv"), 123)


def test_metrics_are_the_scores_and_the_cost(finished_run):
    root, values = finished_run
    scores = pd.read_csv(root / "run" / "scores.csv")
    assert values["score/Full/niah_single_1"] == scores.score.iloc[0]
    assert values["kv_bytes/SnapKV_SparK_0.8_ _64"] == scores.kv_bytes.iloc[1] > 0
    assert values["decode_tok_s/Full"] > 0 and values["predicted_peak_bytes"] == 123
    assert {k.split("/")[0] for k in values} == {"score", "avg", "kv_ratio", "kv_bytes", "prefill_s", "compress_s",
                                                  "decode_tok_s", "peak_mem_bytes", "predicted_peak_bytes",
                                                  "answer_nll", "kl_full", "agree_full"}
    assert values["kl_full/Full"] == 0 and values["agree_full/Full"] == 1 and values["answer_nll/Full"] > 0


def test_mlflow_file_store_round_trip(finished_run, monkeypatch):
    import mlflow

    root, values = finished_run
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # log_run sets it for the default store; so would a user
    tracking.log_run("mlflow", {"model": {"name": "tiny-llama"}, "budget": 64}, root / "run", root, "run", 123)
    client = mlflow.tracking.MlflowClient((root / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("run").experiment_id])
    assert run.data.metrics == pytest.approx(values)
    assert run.data.params == {"model.name": "tiny-llama", "budget": "64"}
    assert run.info.run_name == "run"
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id)) == ["scores.csv", "table.md"]


def _wandb_records(path):
    """The records of a W&B run file (its LevelDB-style log: a 7-byte header, then 32 KiB blocks of records with a
    7-byte header each: crc32, length, type full/first/middle/last), parsed as W&B's protobuf ``Record``."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, offset, parts = 32768, 7, b""
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # the rest of a block too short for a header: padding
            offset += block - offset % block
            continue
        _, length, kind = struct.unpack("<IHB", data[offset:offset + 7])
        parts += data[offset + 7:offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):  # a full record, or the last part of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def test_wandb_offline_round_trip(finished_run, monkeypatch):
    import json

    root, values = finished_run
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracking.log_run("wandb", {"budget": 64}, root / "run", root, "run", 123)
    (path,) = (root / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    summary, kinds, group = {}, set(), None
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        kinds.add(kind)
        if kind == "summary":
            summary.update({u.key: json.loads(u.value_json) for u in record.summary.update})
        if kind == "run":
            group = record.run.run_group
            config = {u.key: json.loads(u.value_json) for u in record.run.config.update}
    assert {k: summary[k] for k in values} == pytest.approx(values)
    assert group == "run" and config["budget"] == 64 and "artifact" in kinds


def test_a_missing_tracker_is_refused_before_the_model_loads(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert tracking.check("wandb") == ("tracking=wandb: the wandb package is not installed (pip install "
                                       "'spark-bench[wandb]')")
    assert tracking.check("none") is None and tracking.check("mlflow") is None
