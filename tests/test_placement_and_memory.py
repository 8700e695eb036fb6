"""Models larger than one device (issue 23): Accelerate device maps give exactly the plain load's tokens, every
per-layer tensor is made on its layer's own device, and a run's peak memory is predicted before the model loads —
close to the measured peak, and refused in one line (or split into smaller decode batches) when it does not fit."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from conftest import SMOLLM2_RUN, model_config
from test_methods import MATRIX
from test_protocol import _compose

from spark_bench import memory
from spark_bench.cli import ConfigError, memory_prediction, resolve_device, run, validate
from spark_bench.engine.clock import peak_memory, reset_peak, resident_now, return_freed_memory
from spark_bench.engine.decode import DecodeRow, decode_rows
from spark_bench.engine.prefill import QueryStatsSpec, run_prefill
from spark_bench.methods import MethodConfig, Pipeline
from spark_bench.models import ModelConfig, load_model, memory_size

CONFIGS = [MethodConfig(name=name, budget=64, **options) for name, options in MATRIX]
SPLIT = {"model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "cpu", "model.norm": "cpu",
         "model.rotary_emb": "cpu", "lm_head": "disk"}  # Accelerate's hooks bring the disk weights in per forward


@pytest.fixture(scope="module")
def mapped_lm(tmp_path_factory):
    cfg = dataclasses.replace(model_config("tiny-llama"), device_map=SPLIT,
                              offload_folder=str(tmp_path_factory.mktemp("offload")))
    return load_model(cfg, "cpu")


def _decode_matrix(model, stack=True):
    """Prefill once, compress under every config of the method matrix, decode all rows together."""
    ids = torch.randint(100, 5000, (1, 160), generator=torch.Generator(device="cpu").manual_seed(0), device="cpu")
    prefill = run_prefill(model, ids, window=32, query_stats=QueryStatsSpec())
    selections = {}
    rows = [DecodeRow(Pipeline.from_config(c).build_cache(prefill, selections=selections)[0], prefill.first_logits,
                      prefill.prompt_length, 6, frozenset()) for c in CONFIGS]
    layer_devices = [layer.keys.device for layer in prefill.layers]
    store_devices = [{t.device for store in (layer.key_store, layer.value_store) for t in vars(store).values()
                      if isinstance(t, torch.Tensor)} for row in rows for layer in row.cache.layers]
    return [r.tokens for r in decode_rows(model, rows, stack=stack)], layer_devices, store_devices


@pytest.fixture(scope="module")
def plain_tokens(tiny_lm):
    return _decode_matrix(tiny_lm.model)[0]


def test_a_device_mapped_model_gives_the_plain_tokens_for_the_method_matrix(mapped_lm, plain_tokens):
    assert mapped_lm.model.hf_device_map == SPLIT and len(mapped_lm.devices) == 1
    assert any(p.device.type == "meta" for p in mapped_lm.model.parameters())  # really offloaded, hooks in use
    tokens, _, _ = _decode_matrix(mapped_lm.model)
    assert tokens == plain_tokens and len(tokens) == len(CONFIGS) > 100


@pytest.mark.parametrize("stack", [True, False])
def test_per_layer_state_is_made_on_its_layers_device(tiny_lm, mapped_lm, plain_tokens, stack):
    """With the default device set to ``meta``, any tensor the prefill, compression or decoding makes without naming
    a device lands on meta and the run fails or its tokens change; every store holds its layer's device (also under
    the device map, whose disk hooks Accelerate runs itself: there the default device stays the CPU)."""
    torch.set_default_device("meta")
    try:
        tokens, layer_devices, store_devices = _decode_matrix(tiny_lm.model, stack)
    finally:
        torch.set_default_device(None)
    assert tokens == plain_tokens
    for lm in (tiny_lm, mapped_lm):
        tokens, layer_devices, store_devices = _decode_matrix(lm.model, stack)
        n = len(layer_devices)
        assert all(devices == {layer_devices[k % n]} for k, devices in enumerate(store_devices))


def test_placement_follows_the_device_map():
    cfg = dataclasses.replace(model_config("tiny-llama"), device_map=SPLIT, offload_folder="/tmp")
    devices = memory.placement(cfg, "cpu")
    arch = memory.Arch.of(cfg)
    assert [(d.name, d.layers, d.first, d.last) for d in devices] == [("cpu", 2, True, True)]
    embed = arch.vocab_size * arch.hidden_size * 4
    assert devices[0].weights < arch.num_params * 4 - embed  # layer 0 and lm_head stay on disk
    full = memory.placement(model_config("tiny-llama"), "cpu")[0]
    assert full.weights == int(arch.num_params * 4) and full.layers == arch.num_layers


@pytest.mark.parametrize("name", ["snapkv", "pyramidkv", "adasnapkv", "streamingllm", "tova", "expected_attention"])
@pytest.mark.parametrize("budget", [40, 0.3])
def test_stored_tokens_is_what_the_eviction_keeps(tiny_prefill, name, budget):
    cfg = MethodConfig(name=name, budget=budget, window_size=16)
    eviction = Pipeline.from_config(cfg).eviction
    n = len(tiny_prefill.layers)
    for i, layer in enumerate(tiny_prefill.layers):
        selection = eviction.select(layer, i, n)
        kept = layer.keys.shape[-2] if selection is None else selection.indices.shape[-1]
        bound = eviction.stored_tokens(tiny_prefill.prompt_length, i, n, layer.num_kv_heads)
        assert kept <= bound if name == "adasnapkv" else kept == bound


def test_the_planner_counts_pyramidkvs_official_fallback():
    """At KV 128 on a 127,500-token prompt the official fork keeps 90% of the prompt in every layer."""
    model = model_config("llama3.1-8b")
    keep90 = memory.plan(MethodConfig(name="pyramidkv", budget=128, pyramid_fallback="keep90", window_size=64),
                         model, 127500, 0, 80)
    ramp = memory.plan(MethodConfig(name="pyramidkv", budget=128, window_size=64), model, 127500, 0, 80)
    assert keep90.stored_prompt_tokens == pytest.approx(0.9 * 127500, abs=1)
    assert 128 <= ramp.stored_prompt_tokens < 160  # its ramp averages about the budget


def test_batch_caches_count_shared_tensors_once():
    """snapkv, snapkv+think and snapkv+spark at one budget share the evicted values (and snapkv's keys)."""
    arch, model = memory.Arch.of(model_config("smollm2-135m")), model_config("smollm2-135m")
    configs = [MethodConfig(name="snapkv", budget=512), MethodConfig(name="snapkv+spark", budget=512, ratio=0.8)]
    alone = sum(memory.plan(c, model, 4096, 0, 80).kv_bytes_per_sequence for c in configs)
    together = memory.predict_run(model, configs, 4096, 0, None, 1).devices[0].caches
    values = arch.num_layers * arch.num_kv_heads * 512 * arch.head_dim * 4
    assert together == pytest.approx(alone - values, rel=0.01)


def _peak_ratio(tmp_path, args):
    proc = subprocess.run([sys.executable, "-m", "spark_bench.cli", "benchmark.tasks=[niah_single_1]",
                           "benchmark.num_samples=1", *args, f"output_root={tmp_path}", "run=r"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "r" / "memory.json").read_text())
    return report["measured_over_predicted"]


@pytest.mark.parametrize("args,bounds", [
    (SMOLLM2_RUN, (0.9, 1.1)),
    (["model=tiny-llama", "benchmark.length=4096"], (0.9, 1.1)),
], ids=["smollm2", "tiny-llama"])
def test_predicted_peak_is_close_to_the_measured_one(tmp_path, request, args, bounds):
    """The peak resident set of a whole run (fresh process) against the prediction made before the model loaded,
    the runtime's and allocator's own memory included (``memory.cpu_overhead``): within 10%, on the demo's model and
    on tiny-llama, whose peak is the teacher-forced fidelity pass after decoding (its logits over a 49,152-token
    vocabulary dwarf a tiny model's caches; 0.98 measured, 1.105 before the planner counted the pass).

    The resident peak depends on how glibc's heap places blocks; the passes with large temporaries map them
    (``engine.clock.mapped_large_blocks``), so it stays within ±1% between processes (SmolLM2: 0.99–1.00, tiny-llama
    0.98, three runs each; before the suffix passes were mapped, SmolLM2's moved between 0.85 and 1.02 of the old
    prediction). A ratio outside the band is measured once more in a fresh process, and that second measurement must
    be inside it. SmolLM2's first measurement is conftest's ``smollm2_run`` (the same command line, shared with
    tests/test_logs.py)."""
    if args is SMOLLM2_RUN:
        run = request.getfixturevalue("smollm2_run")[1]
        ratio = json.loads((run / "memory.json").read_text())["measured_over_predicted"]
    else:
        ratio = _peak_ratio(tmp_path / "first", args)
    if not bounds[0] <= ratio <= bounds[1]:
        ratio = _peak_ratio(tmp_path / "again", args)
    assert bounds[0] <= ratio <= bounds[1]


def test_a_sweep_predicted_not_to_fit_stops_before_the_model_loads(tmp_path, monkeypatch):
    import spark_bench.cli as cli

    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    cfg = _compose(["model=tiny-llama", "memory.limit_gib=0.001", f"output_root={tmp_path}"])
    with pytest.raises(ConfigError) as err:
        run(cfg, tmp_path / "out")
    message = str(err.value)
    assert "\n" not in message and message.startswith("memory: predicted peak")
    assert "exceeds its 0.0 GiB memory.limit_gib even at decode_batch=1" in message
    assert "decode_samples" in message and "model.device_map=auto" in message
    assert not any(tmp_path.iterdir())


def test_the_run_splits_its_decode_batches_to_fit(tmp_path):
    """Between the prediction for every row at once and the one for a row at a time, the run picks the largest
    decode batch that fits and gives the tokens of the unsplit run."""
    # four samples decoded together: their rows' caches and steps, not the fidelity pass (one row at a time), decide
    # the peak; answers bounded as measured, so the early check from the bounds agrees
    base = ["model=tiny-llama", "benchmark.tasks=[niah_single_1]", "benchmark.num_samples=4", "decode_samples=4",
            "benchmark.length=1024", "benchmark.max_new_tokens=16", "progress=false"]
    from spark_bench.cli import load_samples
    from spark_bench.models import LoadedModel, load_tokenizer

    cfg = _compose(base)
    model, configs = validate(cfg)
    samples = load_samples(cfg, LoadedModel(model, None, load_tokenizer(model)))  # the run predicts from them
    whole = memory_prediction(cfg, model, configs, samples=samples)
    one = memory_prediction(_compose(base + ["decode_batch=1"]), model, configs, samples=samples)
    limit = (whole.peak + one.peak) / 2 / memory.GIB
    split = memory_prediction(_compose(base + [f"memory.limit_gib={limit}"]), model, configs, samples=samples)
    assert 1 <= split.decode_batch < whole.decode_batch == 4 * len(configs)
    run(_compose(base + [f"memory.limit_gib={limit}", f"output_root={tmp_path}", "run=split"]), tmp_path / "split")
    run(_compose(base + [f"output_root={tmp_path}", "run=whole"]), tmp_path / "whole")
    read = [[json.loads(line)["tokens"] for line in (tmp_path / r / "predictions.jsonl").open()]
            for r in ("split", "whole")]
    assert read[0] == read[1] and len(read[0]) == 4 * len(configs)
    assert json.loads((tmp_path / "split" / "memory.json").read_text())["prediction"]["decode_batch"] == \
        split.decode_batch


@pytest.mark.parametrize("values,message", [
    ({"device_map": "everywhere"}, "device_map must be null, one of auto, balanced, balanced_low_0, sequential"),
    ({"device_map": {"model.layers.0": "gpu"}}, "device_map['model.layers.0']: 'gpu' is not a device"),
    ({"device_map": "auto", "max_memory": {0: "lots"}}, "max_memory[0] must be a positive size such as 70GiB"),
    ({"device_map": "auto", "max_memory": {"disk": "1GB"}}, "max_memory key 'disk': 'disk' is not a device"),
    ({"max_memory": {0: "70GiB"}}, "max_memory caps a device map's placement: set device_map=auto"),
])
def test_bad_placements_are_refused(values, message):
    with pytest.raises(ValueError, match=None) as err:
        dataclasses.replace(model_config("tiny-llama"), **values)
    assert message in str(err.value)


def test_sizes_and_placement_keywords():
    assert memory_size("70GiB", "k") == 70 * 2 ** 30 and memory_size("500MB", "k") == 500 * 10 ** 6
    assert memory_size(1234, "k") == 1234
    cfg = ModelConfig(name="m", source="hub", device_map="auto", max_memory={"0": "1GiB", "cuda:1": 5, "cpu": "2GB"})
    assert cfg.placement == {"device_map": "auto", "max_memory": {0: 2 ** 30, 1: 5, "cpu": 2 * 10 ** 9}}


@pytest.mark.parametrize("device,message", [
    ("tpu", "device must be one of auto, cpu, cuda, cuda:N; got 'tpu'"),
    ("cuda:7", "device=cuda:7: this machine has"),
])
def test_bad_devices_are_refused(device, message):
    if device.startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has the GPU")
    with pytest.raises(ConfigError) as err:
        resolve_device(device, model_config("tiny-llama"))
    assert message in str(err.value)


def test_a_bad_placement_on_the_command_line_is_one_line(tmp_path, console):
    code, _, err = console(["model=tiny-llama", "model.device_map=everywhere", f"output_root={tmp_path}"])
    assert code == 2 and err.count("\n") == 1
    assert "model: device_map must be null, one of auto" in err and not any(tmp_path.iterdir())


def test_cpu_peaks_reset_and_freed_memory_returns():
    assert return_freed_memory()
    reset_peak(["cpu"])
    before = peak_memory(["cpu"])
    block = torch.ones(64 * 2 ** 20 // 4)  # 64 MiB
    assert peak_memory(["cpu"]) >= before + 60 * 2 ** 20
    del block
    reset_peak(["cpu"])
    assert peak_memory(["cpu"]) < before + 32 * 2 ** 20 and resident_now() <= peak_memory(["cpu"])


@pytest.mark.parametrize("model,gpus,mem", [("llama3.1-70b", 4, 128), ("qwen3-32b", 2, 96), ("llama3-8b", 1, 64)])
def test_the_slurm_launcher_asks_for_the_models_gpus_and_host_memory(model, gpus, mem):
    from hydra import compose, initialize_config_dir

    from spark_bench.cli import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=[f"model={model}", "hydra/launcher=slurm"], return_hydra_config=True)
    assert (cfg.hydra.launcher.gpus_per_node, cfg.hydra.launcher.mem_gb) == (gpus, mem)
    assert cfg.model.device_map == ("auto" if gpus > 1 else None)


HEADROOM = [MethodConfig(name="snapkv", budget=512), MethodConfig(name="snapkv+spark", budget=512, ratio=0.8)]


def test_the_planner_adds_the_graph_pool_workspaces_and_a_fragmentation_margin():
    """On a CUDA device: the run-time check's work at the decode moment, and a margin besides the allocated peak —
    the captured step's pool (where the batch can be graphed: every row stacked, one device), the workspaces and
    5% of the peak above the weights — that the start-up check adds; none of it on the CPU."""
    model = model_config("llama3.1-8b")
    weights = int(memory.Arch.of(model).num_params * 2)
    gpu = [memory.Device("cuda:0", weights, 32)]
    d = memory.predict_run(model, HEADROOM, 8192, 64, None, 1, gpu, suffix=8).devices[0]
    assert d.graph_pool == d.step_work > 0 and d.workspace == memory.CUDA_WORKSPACE
    assert d.fragmentation == int(memory.FRAGMENTATION * max(d.moments.values()))
    assert d.needed == d.peak + d.margin and "GiB needed" in d.line()
    assert d.moments["decode"] == d.caches + d.tail + max(d.step_work, d.check_work) and not d.holds_prefill
    assert d.check_work == memory.check_work(memory.Arch.of(model), 8192, 8) > 8 * 8192 * 128 * 9
    eager = memory.predict_run(model, HEADROOM, 8192, 64, None, 1, gpu, suffix=8, graph=False).devices[0]
    loose = memory.predict_run(model, HEADROOM + [MethodConfig(name="snapkv+spark", budget=512, ratio=0.8,
                                                               recovery="gaussian")], 8192, 64, None, 1, gpu,
                               suffix=8).devices[0]
    two = memory.predict_run(model, HEADROOM, 8192, 64, None, 1, [memory.Device("cuda:0", weights // 2, 16),
                                                                  memory.Device("cuda:1", weights // 2, 16)])
    assert eager.graph_pool == loose.graph_pool == 0 and all(x.graph_pool == 0 for x in two.devices)
    cpu = memory.predict_run(model, HEADROOM, 8192, 64, None, 1, suffix=8).devices[0]
    assert cpu.margin == 0 and cpu.check_work == d.check_work
    # fidelity=false: no fidelity pass, no such moment; the other moments as with it
    off = memory.predict_run(model, HEADROOM, 8192, 64, None, 1, gpu, suffix=8, fidelity=False).devices[0]
    assert set(d.moments) - set(off.moments) == {"fidelity"} and d.moments["fidelity"] > 0
    assert all(off.moments[k] == d.moments[k] for k in off.moments) and off.peak <= d.peak


def test_the_start_up_check_fits_the_peak_with_its_margin():
    """A device with room for the peak but not its margin: a smaller decode batch is chosen; with room for no batch,
    the refusal names the peak with its margin."""
    model = model_config("llama3.1-8b")
    gpu = [memory.Device("cuda:0", int(memory.Arch.of(model).num_params * 2), 32)]
    configs = [MethodConfig(name="snapkv+spark", budget=0.5, ratio=r / 10) for r in range(1, 9)]  # decode-bound
    whole = memory.predict_run(model, configs, 32768, 64, None, 1, gpu, suffix=8).devices[0]
    chosen, over = memory.choose_decode_batch(model, configs, 32768, 64, None, 1, gpu, {"cuda:0": whole.peak + 1},
                                              suffix=8)
    assert not over and chosen.decode_batch < len(configs) and chosen.devices[0].needed <= whole.peak + 1
    one = memory.predict_run(model, configs, 32768, 64, 1, 1, gpu, suffix=8)
    assert memory.over_limit(one, {"cuda:0": one.devices[0].peak})  # room for the peak alone: refused


def test_the_allocator_gets_expandable_segments_unless_the_user_set_it():
    from spark_bench.engine.clock import EXPANDABLE, use_expandable_segments

    env = {}
    assert use_expandable_segments(env) == EXPANDABLE == env["PYTORCH_CUDA_ALLOC_CONF"]
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    assert use_expandable_segments(mine) == "max_split_size_mb:128" and len(mine) == 1
    newer = {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}
    assert use_expandable_segments(newer) == "expandable_segments:False" and len(newer) == 1
    import os

    assert os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")  # set at import
