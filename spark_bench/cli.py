"""``spark-bench`` (run a benchmark × method sweep): the Hydra front end of :mod:`spark_bench.runner`, and the
start-up every tool shares (:mod:`spark_bench.tools`: export, memory planner, merge; :mod:`spark_bench.analysis`).

Every input is checked before the model loads (:func:`validate`, with :mod:`spark_bench.checks`): a bad name,
value, path or data record gives one line on stderr naming the key or file, exit code 2, and nothing written
(``hydra.verbose=true`` shows the traceback). Hydra's own bookkeeping goes to a scratch directory; results go to ``<output_root>/<run>/``
(``/<job number>`` in multiruns, ``/shard-<i>-of-<n>`` with ``shard=i/n``).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from contextlib import ContextDecorator, contextmanager
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from spark_bench import hub, logs
from spark_bench.commandline import check_sweep, compose_jobs, prepare_command_line
from spark_bench.checks import (
    CONF_DIR, PROTOCOL_KEYS, ConfigError, budget_warnings, check_group_choices, check_launcher, check_options,
    check_output, cuda_exists, parse_shard, resolve_device,
)
from spark_bench.usercode import UserCodeError
from spark_bench.models import ModelConfig, load_model, resolve_sources
from spark_bench.samples import benchmark_tasks, check_benchmark, load_samples
from spark_bench.sweep import check_budgets, method_configs

LOG = logging.getLogger("spark_bench.cli")  # also when run as python -m spark_bench.cli

# torch / transformers / the method and benchmark modules are imported inside the functions that need them, after
# the cheap checks (config group names, model and data sources), so a missing model fails in about a second.


def model_config(cfg: DictConfig) -> ModelConfig:
    try:
        return ModelConfig.from_dict(OmegaConf.to_container(cfg.model, resolve=True))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"model: {err}") from None


def validate(cfg: DictConfig, sources: bool = True) -> tuple[ModelConfig, list[MethodConfig]]:
    """Everything that can be checked without the model; raises :class:`ConfigError`.

    ``sources``: also resolve where the model and the data come from (:mod:`spark_bench.hub`: a local directory,
    the hub cache, or a reachable hub), failing within seconds when one is missing. Dry runs only report it.
    """
    try:
        return _validate(cfg, sources)
    except hub.HubUnavailable as err:
        raise ConfigError(str(err)) from None


def _validate(cfg: DictConfig, sources: bool, model_sources: bool = True) -> tuple[ModelConfig, list[MethodConfig]]:
    check_options(cfg)
    model = model_config(cfg)
    if sources and model_sources:  # first, and before torch is imported: a missing model is reported within seconds
        model = resolve_sources(model)
    from spark_bench.methods.pipeline import sweep_labels

    configs = method_configs(cfg)
    try:
        sweep_labels(configs)
    except ValueError as err:
        raise ConfigError(f"sweep.configs: {err}") from None
    try:  # a LeanK mask file against the model's shape (methods/channel/leank.py)
        from spark_bench.methods.channel.leank import check_configs

        check_configs(configs, model)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    parse_shard(cfg.get("shard"))
    from spark_bench import tracking

    unusable = tracking.check(cfg.get("tracking", "none"))
    if unusable:
        raise ConfigError(unusable)
    resolve_device(cfg.get("device", "auto"), model)
    check_benchmark(cfg, model, sources)
    if not cfg.benchmark.get("data_file"):  # exported samples: checked as records (above), not against a length
        check_budgets(cfg, configs)
    return model, configs


def num_layers(model: ModelConfig) -> int:
    """The model's layer count from its ``arch:`` block or ``config.json`` (1 when neither says)."""
    from spark_bench.memory import Arch

    try:
        return Arch.of(model).num_layers
    except ValueError:
        return 1


class quiet_placement(ContextDecorator):  # noqa: N801 — used as a context manager and a decorator
    """Plans place the model over the GPUs that ``model.max_memory`` / ``device_map`` name, present here or not
    (a plan for a cluster made on a laptop): Accelerate's "Device N is not available" warnings are noise there (the
    run's own check names missing GPUs in one line). A class, not a generator: Hydra's multirun launchers pickle
    the functions it decorates."""

    def __enter__(self):
        self.logger = logging.getLogger("accelerate.utils.modeling")
        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)
        return self

    def __exit__(self, *exc) -> bool:
        self.logger.setLevel(self.level)
        return False


@quiet_placement()
def memory_prediction(cfg: DictConfig, model_cfg: ModelConfig, configs: list[MethodConfig], baseline: int = 0,
                      samples=None):
    """The run's predicted peak (:func:`spark_bench.memory.choose_decode_batch`): for ``decode_batch`` when set,
    else for the largest decode batch whose peak plus margin fits each device's free memory (or
    ``memory.limit_gib``). Raises :class:`ConfigError` (one line) when it does not fit and ``memory.check`` is on.
    ``samples``: the run's samples once made (their lengths replace the bounds, :func:`spark_bench.plan.bounds`)."""
    from spark_bench import memory, plan
    from spark_bench.engine.clock import free_memory

    devices = memory.placement(model_cfg, resolve_device(cfg.get("device", "auto"), model_cfg))
    tasks = [] if cfg.benchmark.get("data_file") else benchmark_tasks(cfg)
    scopes = {c.compress_scope for c in configs}
    prompt, new, suffix, answer = plan.bounds(cfg, model_cfg, tasks, scopes, samples)
    graph = bool(cfg.get("decode_graph", True))
    limit = cfg.memory.get("limit_gib")
    if limit is None:
        absent = [d.name for d in devices if d.name.startswith("cuda") and not cuda_exists(d.name)]
        if absent:
            raise ConfigError(f"model.max_memory / model.device_map place the model on {', '.join(absent)}, which "
                              f"this machine lacks; to predict for those GPUs, give their size: memory.limit_gib=80")
    limits = {d.name: int(limit * memory.GIB) if limit is not None else free_memory(d.name) for d in devices}
    prediction, over = memory.choose_decode_batch(model_cfg, configs, prompt, new, cfg.get("decode_batch"),
                                                  cfg.get("decode_samples", 1), devices, limits, baseline, suffix,
                                                  graph, answer, bool(cfg.get("fidelity", True)))
    if over and not cfg.memory.get("check", True):  # run anyway, as configured
        return memory.predict_run(model_cfg, configs, prompt, new, cfg.get("decode_batch"),
                                  cfg.get("decode_samples", 1), devices, baseline, suffix, graph, answer,
                                  bool(cfg.get("fidelity", True)))
    if over:
        device, room = over[0]
        what = "memory.limit_gib" if limit is not None else "free"
        raise ConfigError(
            f"memory: predicted peak {(device.needed - device.baseline) / memory.GIB:.1f} GiB (margin included) on "
            f"{device.device} exceeds "
            f"its {room / memory.GIB:.1f} GiB {what} even at decode_batch={prediction.decode_batch} "
            f"({device.line().split(' = ', 1)[1]}); lower decode_samples, decode_batch or the longest prompt "
            f"(benchmark.length / longbench.max_length), or spread the model with model.device_map=auto "
            f"(memory.check=false runs anyway)")
    return prediction


def source_lines(cfg: DictConfig, model: ModelConfig) -> list[str]:
    """Where a run would read its model and hub data from (dry runs print this instead of failing)."""
    lines = []
    if model.source == "hub":
        lines.append(f"model {model.name}: {hub.describe(model.path, 'model')}")
    if not cfg.benchmark.get("data_file") and cfg.benchmark.name == "longbench" and cfg.longbench.data_dir is None:
        lines.append(f"LongBench data: {hub.describe(cfg.longbench.hub_path, 'dataset')}")
    if not cfg.benchmark.get("data_file") and cfg.benchmark.name == "ruler" and cfg.ruler.get("source") == "kvpress":
        lines.append(f"RULER records: {hub.describe(cfg.ruler.kvpress_path, 'dataset')}")
    return lines


def output_dir(cfg: DictConfig) -> Path:
    out = Path(cfg.output_root) / cfg.run
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        out = out / str(HydraConfig.get().job.num)
    shard = parse_shard(cfg.get("shard"))
    return out / f"shard-{shard[0]}-of-{shard[1]}" if shard else out


def run_payload(cfg: DictConfig, lm, samples, configs) -> dict:
    """The results directory's fingerprint: configs, model, samples, benchmark settings and shard."""
    from spark_bench.runner import default_payload

    keep = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "benchmark", "longbench", "ruler")}
    return {**default_payload(lm, samples, configs), **keep, "shard": cfg.get("shard")}


def protocol_line(cfg: DictConfig) -> str:
    """``protocol: official (compress_scope=question, window_size=64, …)``: the protocol chosen and the values its
    keys have after the command line (which may override some)."""
    try:
        name = HydraConfig.get().runtime.choices.get("protocol")
    except ValueError:  # not under Hydra (tests, scripts)
        name = None
    values = [f"{k}={cfg.get(k)}" for k in PROTOCOL_KEYS]
    if cfg.benchmark.name == "longbench":
        values.append(f"longbench.protocol={cfg.longbench.get('protocol')}")
    return f"protocol: {name or '(none)'} ({', '.join(values)})"


def plan_lines(cfg: DictConfig, model_cfg: ModelConfig, configs: list[MethodConfig]) -> list[str]:
    """The run's cost plan (:mod:`spark_bench.plan`): samples per task, configs, decode forwards, KV per sample and
    hours."""
    if cfg.benchmark.get("data_file"):
        return ["plan: the samples of benchmark.data_file (export's records; no published counts to plan with)"]
    if not model_cfg.arch:
        return [f"plan: model {model_cfg.name} has no `arch:` block, so no memory or time estimate"]
    work, cost = plan_cost(cfg, model_cfg, configs)
    per_task = ", ".join(f"{w.task} {w.samples}" for w in work)
    sources = sorted({w.source for w in work})
    return [f"plan: samples per task ({'/'.join(sources)}): {per_task}", *cost.lines()]


def plan_cost(cfg: DictConfig, model_cfg: ModelConfig, configs: list[MethodConfig]):
    """``(work per task, plan.Cost)`` of a run on its benchmark's published sample counts (model with ``arch:``):
    what :func:`plan_lines` prints, and what the docs' GPU-hour tables are checked against (tests/test_docs.py)."""
    from spark_bench import plan

    if cfg.benchmark.name == "longbench":
        work = plan.longbench_work(cfg)
        prompt = model_cfg.longbench_max_length or model_cfg.max_length - 500
    else:
        work = plan.ruler_work(cfg, benchmark_tasks(cfg))
        prompt = int(cfg.benchmark.length)
    return work, plan.estimate(model_cfg, configs, work, prompt, fidelity=bool(cfg.get("fidelity", True)))


@contextmanager
def _locked(out_dir: Path, wait: bool):
    """:func:`spark_bench.results.run_lock`, a held lock reported as a :class:`ConfigError`."""
    from spark_bench.results import RunLocked, run_lock

    lock = run_lock(out_dir, wait)
    try:
        lock.__enter__()
    except RunLocked as err:
        raise ConfigError(f"run={out_dir.name}: {err}") from None
    try:
        yield
    except BaseException:  # the lock sees the failure (a run refused before writing anything leaves no lock)
        if not lock.__exit__(*sys.exc_info()):
            raise
    else:
        lock.__exit__(None, None, None)


class DryRunStop(ConfigError):
    """A dry run found problems the real run would stop at (one line each)."""


def dry_run(cfg: DictConfig, out_dir: Path) -> None:
    """Validate, print the plan (labels, protocol, sources, cost, memory) and exit non-zero, one line per problem,
    when the real run would stop at start-up (the model or the data not resolvable)."""
    from spark_bench.methods.pipeline import sweep_labels

    model_cfg, configs = validate(cfg, sources=False)
    tasks = "data_file" if cfg.benchmark.get("data_file") else ", ".join(benchmark_tasks(cfg))
    print(f"spark-bench (dry run): {model_cfg.name} on {cfg.benchmark.name} [{tasks}] × {len(configs)} method "
          f"configs → {out_dir}\n" + "\n".join(f"  {label}" for label in sweep_labels(configs)), flush=True)
    print(f"  {protocol_line(cfg)}", flush=True)
    for line in source_lines(cfg, model_cfg):
        print(f"  source: {line}", flush=True)
    for line in plan_lines(cfg, model_cfg, configs):
        print(f"  {line}", flush=True)
    try:  # dry runs plan GPU jobs from machines without those GPUs: not fitting *here* is reported, not fatal,
        prediction = memory_prediction(cfg, model_cfg, configs)  # unless memory.limit_gib names the size
    except ConfigError as err:
        if cfg.memory.get("limit_gib") is not None:
            raise
        print(f"  {err} [not fatal in a dry run: it predicts for this machine's devices]", flush=True)
    else:
        for line in prediction.lines():
            print(f"  {line}", flush=True)
    problems = []
    try:
        resolve_sources(model_cfg)
    except hub.HubUnavailable as err:
        problems.append(str(err))
    try:
        _validate(cfg, sources=True, model_sources=False)
    except (ConfigError, hub.HubUnavailable) as err:
        problems.append(str(err))
    if problems:
        raise DryRunStop("\n".join(f"the run would stop: {p}" for p in problems))


def _compute(cfg: DictConfig, out_dir: Path, model_cfg: ModelConfig, configs: list, text, samples: list,
             payload: dict, complete: bool, prediction, decode_batch) -> None:
    """The validated run: load the model unless every prediction is on disk, run the sweep, write the config and
    the memory report (``run.log`` records it)."""
    from spark_bench import memory
    from spark_bench.engine.clock import resident_now
    from spark_bench.results import ResultsMismatch
    from spark_bench.runner import run_sweep

    loaded = 0
    if complete:  # nothing to compute: the tables from what is on disk, no model
        lm = text
        LOG.info(f"{out_dir} already holds every prediction; the model is not loaded")
    else:
        lm = load_model(model_cfg, resolve_device(cfg.device, model_cfg))
        loaded = resident_now()
    LOG.info(f"{model_cfg.name} on {cfg.benchmark.name} ({len(samples)} samples) × {len(configs)} method "
             f"configs → {out_dir}; {protocol_line(cfg)}")
    try:
        predictions = run_sweep(lm, samples, configs, out_dir, payload=payload,
                                progress=bool(cfg.get("progress", True)),
                                decode_batch=decode_batch, decode_samples=cfg.get("decode_samples", 1),
                                decode_stack=cfg.get("decode_stack", True), decode_graph=cfg.get("decode_graph", True),
                                fidelity=cfg.get("fidelity", True))
        (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True), encoding="utf-8")
        if not complete:
            memory.write_report(out_dir / "memory.json", prediction, predictions, loaded)
    except ResultsMismatch as err:
        from spark_bench.upgrade import mismatch_line

        raise ConfigError(mismatch_line(err, cfg)) from None
    except OSError as err:  # disk full, permissions changed: what was written stays valid and resumes
        where = err.filename or out_dir
        raise ConfigError(f"writing {where} failed: {err.strerror or err}; the predictions written before are "
                          f"kept and a rerun resumes from them") from None


def run(cfg: DictConfig, out_dir: Path) -> None:
    """Validate everything, then (unless ``dry_run``) lock ``out_dir``, make the samples, and load the model only
    when some prediction is still missing."""
    if cfg.get("hub_timeout_s") is not None:
        hub.set_timeout(float(cfg.hub_timeout_s))
    if cfg.get("dry_run"):
        return dry_run(cfg, out_dir)
    model_cfg, configs = validate(cfg)
    check_output(out_dir)
    from spark_bench.engine.clock import resident_now, return_freed_memory
    from spark_bench.models import LoadedModel, load_tokenizer
    from spark_bench.results import DamagedFile, ResultsDir, ResultsMismatch
    from spark_bench import memory, provenance, runner, tracking, upgrade  # noqa: F401 — before the baseline

    start = time.perf_counter()
    return_freed_memory()
    tokenizer = load_tokenizer(model_cfg)  # (cached for load_model) in the resident baseline of the prediction
    memory_prediction(cfg, model_cfg, configs, baseline=resident_now())  # the bounds: refused before anything is written
    with _locked(out_dir, wait=bool(cfg.get("wait_lock", False))):
        text = LoadedModel(model_cfg, None, tokenizer)  # the samples need the tokenizer, not the model
        try:
            samples = load_samples(cfg, text)
            for scope in {c.compress_scope for c in configs}:  # every sample has the boundaries its scopes need
                for sample in samples:
                    sample.scope_end(scope)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        for line in budget_warnings(samples, configs, num_layers(model_cfg)):
            LOG.warning(f"warning: {line}")
        prediction = memory_prediction(cfg, model_cfg, configs, baseline=resident_now(), samples=samples)
        decode_batch = cfg.get("decode_batch")  # ^ the samples' own lengths, before the model loads
        if decode_batch is None and prediction.decode_batch < prediction.rows:
            decode_batch = prediction.decode_batch
            LOG.info(f"memory: decode_batch={decode_batch} (all {prediction.rows} rows together are predicted not "
                     f"to fit with their margin: {max(prediction.devices, key=lambda d: d.needed).line()})")
        payload = run_payload(cfg, text, samples, configs)
        refusal, note = upgrade.old_default_dir(cfg, out_dir, payload)  # an older version's default directory
        if refusal:
            raise ConfigError(refusal)
        if note:
            LOG.warning(note)
        try:
            from spark_bench.methods.pipeline import sweep_labels

            labels = sweep_labels(configs)
            results = ResultsDir(out_dir, payload, upgrade.same_study)
            for line in results.check_files(repair=bool(cfg.get("repair", False))):
                LOG.warning(line)
            complete = results.complete([s.id for s in samples], labels,
                                        runner.cache_fields(cfg.get("fidelity", True)))
            # every refusal is behind: the session's record is written as it starts (a SIGKILL leaves it)
            results.open({"samples": [[s.id, s.task] for s in samples], "configs": labels})
            for line in results.start(provenance.session(resolve_device(cfg.device, model_cfg))):
                LOG.warning(line)
        except ResultsMismatch as err:
            raise ConfigError(upgrade.mismatch_line(err, cfg)) from None
        except DamagedFile as err:
            raise ConfigError(f"run={cfg.run}: {err}") from None
        with logs.to_file(out_dir / "run.log"):
            try:
                _compute(cfg, out_dir, model_cfg, configs, text, samples, payload, complete, prediction,
                         decode_batch)
            except BaseException as err:  # e.g. the model failed to load: the session's record says so
                results.end_session(f"stopped: {type(err).__name__}: {str(err)[:200]}", strict=False)
                raise
            tracking.log_run(cfg.get("tracking", "none"), OmegaConf.to_container(cfg, resolve=True), out_dir,
                             Path(cfg.output_root), cfg.run, prediction.peak)
    print(f"\n{(out_dir / 'table.md').read_text()}", flush=True)
    LOG.info(f"wall time {time.perf_counter() - start:.0f}s; results in {out_dir}")


def fail(tool: str, cfg: DictConfig | None, err: Exception) -> None:
    """A user error: one ``<tool>: error: <line>`` per line of ``err`` on stderr, exit 2 (``hydra.verbose=true``
    or ``-v``: its traceback first; still exit 2, a user error, not the internal error of
    :class:`~spark_bench.logs.last_resort`)."""
    hydra_verbose = HydraConfig.initialized() and HydraConfig.get().verbose
    if hydra_verbose or (logs.verbosity() >= logs.VERBOSE and err.__cause__ is not None):
        import traceback  # (-v: where there is more to see than the line, the user's own code failing)

        traceback.print_exception(type(err), err, err.__traceback__, file=sys.stderr)
    for line in str(err).splitlines() or [""]:  # one line per problem (a dry run may find several)
        print(f"{tool}: error: {line}", file=sys.stderr)
    sys.exit(2)


def user_code_failed(tool: str, cfg: DictConfig | None, err: UserCodeError) -> None:
    """A method of the user's failed (:mod:`spark_bench.usercode`): a user error, exit 2, in one line; at run time
    (the run's ``run.log`` open) the traceback goes there, the line says so, and what was written stays
    (``predictions.jsonl`` is appended per sample, so the rerun resumes after the fix). ``-v`` prints it too."""
    if logs.run_log() is not None:
        where = logs.write_traceback(err, header=tool)
        said = ConfigError(f"{err}; traceback in {where}; the predictions written before are kept, and a rerun "
                           "resumes")
        said.__cause__ = err
        err = said
    fail(tool, cfg, err)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    with logs.last_resort("spark-bench"):  # inside the task: @hydra.main would catch it first (logs.last_resort)
        try:
            run(cfg, output_dir(cfg))
        except (ConfigError, FileNotFoundError) as err:
            fail("spark-bench", cfg, err)
        except UserCodeError as err:
            user_code_failed("spark-bench", cfg, err)


def checked(tool: str, entry, check_job=None) -> None:
    """Run a console script's Hydra ``entry`` once its command line composes (:mod:`spark_bench.commandline`:
    a bad key is one line, exit 2). A multirun is checked whole first: every job's config through ``check_job``
    (the checks a job runs before its model loads); one bad job refuses the sweep, one line per bad job.
    ``-q`` / ``-v`` anywhere on the command line set the verbosity (:mod:`spark_bench.logs`) and are not Hydra's.
    Runs under :class:`~spark_bench.logs.last_resort` (an unexpected exception: one line, exit 1); ``entry``'s
    task function runs its own body under it too."""
    verbosity, sys.argv[1:] = logs.take_flags(sys.argv[1:])
    logs.configure(verbosity, tool)
    with logs.last_resort(tool):
        try:
            prepare_command_line(sys.argv[1:])  # kvpress:<press> and methods of one's own as method= choices
            check_group_choices(sys.argv[1:])
            check_launcher(sys.argv[1:])
            jobs = compose_jobs(sys.argv[1:])
            if check_job is not None and len(jobs) > 1:
                check_sweep(jobs, check_job)
        except ConfigError as err:
            fail(tool, None, err)
        entry()


def _check_run_job(cfg: DictConfig) -> None:
    validate(cfg)
    check_output(Path(cfg.output_root) / cfg.run)


def main() -> None:
    checked("spark-bench", _hydra_main, _check_run_job)


if __name__ == "__main__":
    main()
