"""A study survives an upgrade of spark-bench: what a newer version does with a run directory an older one wrote.

* :func:`old_default_dir`: the default run directory was ``<model>_<benchmark>`` before it became
  ``<model>_<benchmark>_<hash of the configuration>``. A rerun of an old study's command (``run=`` left out) that
  finds the old directory holding this very configuration is refused in one line giving the exact ``run=`` that
  continues it (or the one that starts afresh), instead of silently starting elsewhere.
* :func:`same_study`: a newer version may add an option (``benchmark.truncate``, a method option) and with it a
  key to the payload a run directory is fingerprinted by. A directory whose payload lacks only such keys, each at
  its default (the value the old version's behaviour had), holds the same study: it is resumed, and its manifest
  says what was added (``upgraded``).
* :func:`mismatch_line`: a directory refused as "a different configuration" because the sweep changed (a
  built-in sweep edited by an upgrade, or one's own) says which sweep file, which configs were added, removed or
  changed, and what to do: the sweep the run began with, or a new ``run=``.
* :func:`refresh`: resuming a run whose earlier predictions lack fields this version writes. What the stored
  predictions and the samples determine is restored (the score is recomputed from the stored prediction text by
  this version's metric; the task, answers, length and method options filled in, the generated tokens counted and
  whether the row stopped on its own read from them and ``max_new_tokens``); what needs the caches (the
  fidelity numbers ``answer_nll`` / ``kl_full`` / ``agree_full``, the KV bytes) is recomputed: those predictions are
  computed again, so no table averages a column over fewer samples than its ``n`` says.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from spark_bench.checks import CONF_DIR, config_hash
from spark_bench.results import ResultsMismatch, fingerprint, manifest_records, read_manifest


def default_run(cfg: DictConfig) -> str:
    """The run name ``run`` gets when it is left out (``conf/config.yaml``)."""
    return f"{cfg.model.name}_{cfg.benchmark.name}_{config_hash(_root_=cfg)}"


def old_default_dir(cfg: DictConfig, out_dir: Path, payload: dict) -> tuple[str | None, str | None]:
    """``(refusal, note)`` for a run whose ``run`` was left out and whose default directory holds nothing yet, when
    another default directory of the same model and benchmark holds this very study (``payload``'s fingerprint,
    or :func:`same_study`): ``<model>_<benchmark>`` (the default before the configuration's hash joined it) or
    ``<model>_<benchmark>_<hash>`` under another hash (a version that added an option changes every hash: the key
    joins the configuration at its default). The same sub-path is looked at for a multirun job or shard. The
    refusal names the ``run=`` that continues it and the one that starts afresh. When only the un-hashed directory
    of an older version exists, holding another configuration: a note. ``(None, None)`` otherwise."""
    if cfg.get("run") != default_run(cfg):
        return None, None
    root = Path(cfg.output_root)
    legacy = f"{cfg.model.name}_{cfg.benchmark.name}"
    try:
        inner = out_dir.relative_to(root / cfg.run)
    except ValueError:
        return None, None
    if (out_dir / "manifest.json").exists():  # this default directory's own run: it resumes (or is refused) there
        return None, None
    siblings = sorted(p for p in root.glob(f"{legacy}_*") if re.fullmatch(r"[0-9a-f]{8}", p.name[len(legacy) + 1:])
                      and p.name != cfg.run) if root.is_dir() else []
    note = None
    for name in [legacy, *(p.name for p in siblings)]:
        path = root / name / inner / "manifest.json"
        if not path.is_file():
            continue
        try:
            manifest = read_manifest(path)
        except ValueError:
            continue
        if name == legacy and "runs" in manifest:  # written by this version with run= given: not an old default
            continue
        said = (f"{path.parent} holds a run begun under another default run directory ({name}; this "
                f"configuration's is now {cfg.run}: the default directory's hash changes when a newer spark-bench "
                f"adds an option)" if name != legacy else
                f"{path.parent} holds a run begun by an older spark-bench, whose default run directory was "
                f"<model>_<benchmark> (now <model>_<benchmark>_<hash of the configuration>, here {out_dir})")
        if manifest.get("fingerprint") == fingerprint(payload) or same_study(manifest.get("payload"),
                                                                             payload) is not None:
            return (f"run: {said}, and it is this configuration's: continue it with run={name}, or start afresh in "
                    f"{out_dir} with run={cfg.run}"), None
        if name == legacy:
            note = f"note: {said}, of another configuration; this run starts in {out_dir}"
    return None, note


def _defaults(section: str, name) -> list:
    """The values an added payload key may have to count as its default: the conf files that declare it."""
    files = {"benchmark": sorted((CONF_DIR / "benchmark").glob("*.yaml")),
             "model": [CONF_DIR / "model" / f"{name}.yaml"], "longbench": [CONF_DIR / "config.yaml"],
             "ruler": [CONF_DIR / "config.yaml"]}.get(section, [])
    out = []
    for path in files:
        try:
            values = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        except Exception:  # noqa: BLE001 — a missing or unreadable file declares nothing
            continue
        out.append(values.get(section, {}) if section in ("longbench", "ruler") else values)
    return out


def _method_defaults() -> dict[str, list]:
    """Each method option's defaults: MethodConfig's, and what each protocol sets."""
    from spark_bench.checks import protocol_options
    from spark_bench.methods.config import MethodConfig

    out = {k: [v] for k, v in MethodConfig().to_dict().items()}
    for path in sorted((CONF_DIR / "protocol").glob("*.yaml")):
        for k, v in protocol_options(path.stem).items():
            out.setdefault(k, []).append(v)
    return out


def _added(old, new, defaults: list, where: str) -> list[str] | None:
    """The keys ``new`` adds to ``old`` (mappings, recursively), each at a value one of ``defaults`` (mappings
    alike) declares; None when anything else differs."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return [] if old == new else None
    if set(old) - set(new):
        return None
    out = []
    for key, value in new.items():
        inner = [d.get(key) for d in defaults if isinstance(d, dict) and key in d]
        if key not in old:
            if not any(value == d for d in inner):
                return None
            out.append(f"{where}.{key}")
            continue
        found = _added(old[key], value, inner, f"{where}.{key}")
        if found is None:
            return None
        out += found
    return out


def same_study(old: dict, new: dict) -> list[str] | None:
    """Whether payload ``new`` is ``old`` as this version writes it: equal but for keys a newer version added,
    each at its default (conf files, MethodConfig, the protocols). The added keys (``benchmark.truncate``,
    ``configs.foo``), or None when the two differ otherwise."""
    if not isinstance(old, dict) or set(old) != set(new):
        return None
    added = []
    for key, value in new.items():
        if key == "configs":
            before = old.get("configs")
            if not isinstance(before, list) or len(before) != len(value):
                return None
            defaults = _method_defaults()
            for a, b in zip(before, value):
                if not isinstance(a, dict) or set(a) - set(b) or any(a[k] != b[k] for k in a):
                    return None
                extra = [k for k in b if k not in a]
                if any(b[k] not in defaults.get(k, []) for k in extra):
                    return None
                added += [f"configs.{k}" for k in extra]
            continue
        name = (value or {}).get("name") if isinstance(value, dict) else None
        found = _added(old.get(key), value, _defaults(key, name), key)
        if found is None:
            return None
        added += found
    return sorted(set(added))


def _sweep_file(cfg: DictConfig) -> str | None:
    """``sweep=<name> (conf/sweep/<name>.yaml)`` of the built-in sweep whose entries are the run's, if one is."""
    if cfg.get("method") or "sweep" not in cfg:
        return None
    entries = OmegaConf.to_container(cfg.sweep.configs, resolve=True)
    for path in sorted((CONF_DIR / "sweep").glob("*.yaml")):
        try:
            if OmegaConf.to_container(OmegaConf.load(path), resolve=True).get("configs") == entries:
                return f"sweep={path.stem} (conf/sweep/{path.name})"
        except Exception:  # noqa: BLE001 — an unreadable file is not the run's sweep
            continue
    return None


def _labels(configs: list) -> list[str]:
    """Table labels of a manifest's method configs (their names where a config no longer builds)."""
    from spark_bench.methods.config import MethodConfig, sweep_labels

    try:
        return sweep_labels([MethodConfig.from_dict(dict(c)) for c in configs])
    except (TypeError, ValueError):
        return [str(c.get("name")) if isinstance(c, dict) else str(c) for c in configs]


def _listed(labels: list[str], limit: int = 3) -> str:
    return ", ".join(labels[:limit]) + (f", … ({len(labels)} in all)" if len(labels) > limit else "")


def sweep_changes(old: list, new: list) -> str:
    """``2 added (A, B), 1 removed (C), 1 changed (D: window_size 32 → 64)`` between two lists of method configs
    (matched by label), or ``the same configs in another order``; '' when equal."""
    if old == new:
        return ""
    old_labels, new_labels = _labels(old), _labels(new)
    before, after = dict(zip(old_labels, old)), dict(zip(new_labels, new))
    added = [label for label in new_labels if label not in before]
    removed = [label for label in old_labels if label not in after]
    changed = []
    for label in new_labels:
        if label in before and before[label] != after[label]:
            a, b = before[label], after[label]
            keys = [k for k in dict.fromkeys([*a, *b]) if json.dumps(a.get(k), default=str) != json.dumps(
                b.get(k), default=str)]
            changed.append(f"{label}: " + ", ".join(f"{k} {a.get(k, '(absent)')} → {b.get(k, '(absent)')}"
                                                    for k in keys[:3]))
    parts = [f"{len(added)} added ({_listed(added)})" if added else "",
             f"{len(removed)} removed ({_listed(removed)})" if removed else "",
             f"{len(changed)} changed ({'; '.join(changed[:2])}{'; …' if len(changed) > 2 else ''})"
             if changed else ""]
    text = ", ".join(p for p in parts if p)
    return text or "the same configs in another order"


def mismatch_line(err: ResultsMismatch, cfg: DictConfig) -> str:
    """The refusal of a directory holding another configuration, and when its method configs changed, which sweep
    file, what changed in it and how to go on (the sweep the run began with, or a new ``run=``)."""
    text = str(err)
    if "configs" not in err.changed:
        return text
    changes = sweep_changes(err.old.get("configs") or [], err.new.get("configs") or [])
    where = _sweep_file(cfg) or ("method=" if cfg.get("method") else "sweep.configs")
    path = Path(text.split(" holds results", 1)[0])
    manifest = {}
    try:
        manifest = read_manifest(path / "manifest.json")
    except (OSError, ValueError):
        pass
    runs, _ = manifest_records(manifest, "runs")
    from spark_bench.provenance import version_text

    began = version_text(runs[0]) if runs else "an older spark-bench (before it recorded its version)"
    fresh = f"{cfg.run}_{fingerprint(err.new)[:8]}"
    head = text.split("; choose another run=", 1)[0]
    return (f"{head}; {where} now differs from the configs the run began with: {changes}; to continue the run, "
            f"use the configs it began with (payload.configs in {path / 'manifest.json'}; begun by spark-bench "
            f"{began}), or give the changed configs a new run= (e.g. run={fresh})")


def refresh(done: dict, samples: list, pipelines: list, needed: tuple) -> tuple[int, int, list[str]]:
    """Bring resumed prediction records (``done``: ``(id, config) → record``, changed in place) up to this version:
    the task, answers, length and method options filled in from the sample and the config, the score recomputed
    from the stored prediction text by this version's metric; a record lacking any of ``needed`` (fields that need
    the model and the caches, e.g. the fidelity numbers) is dropped from ``done`` so that it is computed again.
    ``(rescored, dropped, lines to log)``."""
    from spark_bench.benchmarks.metrics import score

    by_id = {s.id: s for s in samples}
    configs = {p.label: p.config.to_dict() for p in pipelines}
    rescored, stale, missing = 0, [], {}
    for key, record in list(done.items()):
        sample = by_id.get(record.get("id"))
        if sample is None or record.get("config") not in configs:
            continue
        lacking = [f for f in needed if f not in record]
        if lacking or "prediction" not in record:
            stale.append(key)
            for f in lacking:
                missing[f] = missing.get(f, 0) + 1
            del done[key]
            continue
        record.setdefault("task", sample.task)
        record.setdefault("answers", list(sample.answers))
        record.setdefault("length", sample.meta.get("length"))
        record.setdefault("question", sample.meta.get("question"))  # its position among its context's questions
        record.setdefault("method", configs[record["config"]])
        tokens = record.get("tokens") or []  # a record without its tokens was dropped above (a cache field)
        record.setdefault("new_tokens", len(tokens))
        if "stopped" not in record:  # only a stop token ends a row before its max_new_tokens
            record["stopped"] = len(tokens) < sample.max_new_tokens
        record.setdefault("fidelity", "answer_nll" in record)  # whether the fidelity pass ran for it
        new = score(sample.metric, record["prediction"], sample.answers, **sample.metric_args)
        if record.get("score") != new:
            rescored += 1
            record["score"] = new
    lines = []
    if stale:
        what = ", ".join(missing) or "prediction"
        lines.append(f"resume: {len(stale)} stored prediction(s) of {len({k[0] for k in stale})} sample(s) lack "
                     f"{what} (written by an older spark-bench; they need the caches): computed again")
    if rescored:
        lines.append(f"resume: {rescored} stored score(s) differ from this version's scoring of the stored "
                     f"predictions: rescored")
    return rescored, len(stale), lines
