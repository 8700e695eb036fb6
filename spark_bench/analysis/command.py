"""``spark-bench-saliency`` (Observation 1 on any model and benchmark: CV, top-T overlap, Fig. 2a/2b and Appendix B
figures) and ``spark-bench-figure2`` (Fig. 2c's relative-loss table and figure from a run of the Observation 2 sweep,
and the appendix's batch-size/memory figure from ``spark-bench-memory``'s JSON).

``spark-bench-saliency`` takes the command line of ``spark-bench`` (model, benchmark, its samples) plus the
``analysis.*`` keys; everything is checked before the model loads, as for a run. It prefills each prompt once
(:func:`~spark_bench.engine.prefill.run_prefill`, the engine's own capture: one forward, no global patching) and
writes ``saliency.json``, ``cv_per_layer_head.csv``, ``summary.md`` and the PNGs into ``analysis.out``.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import hydra
import numpy as np
import pandas as pd
from omegaconf import DictConfig

from spark_bench.checks import CONF_DIR, ConfigError, check_output, resolve_device
from spark_bench.cli import checked, fail, load_samples, output_dir, validate
from spark_bench import logs
from spark_bench.models import load_model

LOG = logging.getLogger(__name__)


def analysis_target(cfg: DictConfig, model) -> tuple[int, int]:
    """The layer and kv-head of the figures, checked against the model's shape (``arch:`` or its config.json)
    before it loads."""
    from spark_bench.analysis.saliency import default_layer
    from spark_bench.memory import Arch

    arch = Arch.of(model)
    a = cfg.analysis
    layer = default_layer(arch.num_layers) if a.layer is None else a.layer
    if layer >= arch.num_layers:
        raise ConfigError(f"analysis.layer={layer}: model {model.name} has {arch.num_layers} layers (0–"
                          f"{arch.num_layers - 1}), or null")
    if a.head >= arch.num_kv_heads:
        raise ConfigError(f"analysis.head={a.head}: model {model.name} has {arch.num_kv_heads} kv-heads (0–"
                          f"{arch.num_kv_heads - 1})")
    return layer, a.head


def run_saliency(lm, samples, cfg: DictConfig, layer: int, head: int, out: Path, log=None) -> dict:
    import torch

    from spark_bench.analysis import figures
    from spark_bench.analysis.saliency import PAPER_CV, analyze, summarize
    from spark_bench.engine.prefill import run_prefill

    log = log or LOG.info
    a = cfg.analysis
    ratios = [float(r) for r in a.ratios]
    results = []
    for sample in samples:
        ids = torch.tensor([list(sample.input_ids)], device=lm.device)
        prefill = run_prefill(lm.model, ids, a.window)
        results.append(analyze(prefill, sample.id, a.query, a.window, ratios, layer, head))
        log(f"{sample.id} ({prefill.prompt_length} tok): mean CV {np.nanmean(results[-1].cv):.3f}")
        del prefill
    summary = summarize(results, layer, head)
    summary.update(model=lm.config.name, query=a.query, window=a.window,
                   benchmark=cfg.benchmark.name, tasks=sorted({s.task for s in samples}))
    out.mkdir(parents=True, exist_ok=True)
    (out / "saliency.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    per_head = np.asarray(summary["cv_per_layer_head"])
    pd.DataFrame([{"layer": i, "kv_head": h, "mean_cv": per_head[i, h]} for i in range(per_head.shape[0])
                  for h in range(per_head.shape[1])]).to_csv(out / "cv_per_layer_head.csv", index=False)
    first = results[0]
    where = f"{lm.config.name}, layer {layer}, kv-head {head}, {first.sample_id}"
    names = [figures.surface(first.chosen, f"Fig. 2a: {where}", out / "fig2a_surface.png").name,
             figures.cv_figure(np.nanmean([r.cv[layer, head] for r in results], axis=0),
                               np.stack([r.cv for r in results]).mean(axis=0),
                               f"Fig. 2b: CV per channel, layer {layer}, kv-head {head}", out / "fig2b_cv.png",
                               PAPER_CV).name,
             figures.token_patterns(first.chosen, f"Appendix B: six tokens, {where}",
                                    out / "appB_token_patterns.png").name,
             figures.scatter(first.chosen, f"Appendix B: {where}", out / "appB_scatter.png").name,
             figures.heatmap(first.chosen, f"Appendix B: {where}", out / "appB_heatmap.png").name]
    (out / "summary.md").write_text(summary_markdown(summary, names), encoding="utf-8")
    log(summary["verdict"])
    return summary


def summary_markdown(summary: dict, figures: list[str]) -> str:
    def cell(x: dict, digits: int = 3) -> str:
        return f"{x['mean']:.{digits}f} [{x['low']:.{digits}f}, {x['high']:.{digits}f}]"

    lines = [f"# Channel saliency: {summary['model']} on {summary['benchmark']} ({', '.join(summary['tasks'])})", "",
             f"{summary['samples']} prompts ({min(summary['tokens'])}–{max(summary['tokens'])} tokens); "
             f"contribution c[t,j] = |q_j·k_tj| with q = {summary['query']} (window {summary['window']}); "
             f"{summary['layers']} layers × {summary['kv_heads']} kv-heads × {summary['head_dim']} channels. "
             "Means over prompts with 95% bootstrap intervals.", "",
             f"**{summary['verdict']}.**", "",
             "| Quantity | Value |", "|---|---|",
             f"| mean CV, every layer / kv-head / channel | {cell(summary['cv_all'])} |",
             f"| mean CV, layer {summary['layer']} kv-head {summary['head']} (the figures') | "
             f"{cell(summary['cv_chosen_head'])} |"]
    for ratio, o in summary["overlap"].items():
        lines.append(f"| λ={ratio}: top-{o['kept']} overlap between tokens (1 = structured, {o['chance']:.3f} = "
                     f"unrelated) | {cell(o['overlap'])} |")
        lines.append(f"| λ={ratio}: share of a token's top-{o['kept']} inside the head's best {o['kept']} "
                     f"(what a structured method keeps) | {cell(o['recall'])} |")
    lines += ["", "Figures: " + ", ".join(f"`{f}`" for f in figures) + "; per layer and head: "
              "`cv_per_layer_head.csv`.", ""]
    return "\n".join(lines)


def prepare(cfg: DictConfig):
    """Everything checked before the model loads: the run's keys, model and data sources, the ``analysis.*`` keys
    against the model's shape, the output place. Returns (model config, device, layer, head, output directory)."""
    model_cfg, _ = validate(cfg)
    layer, head = analysis_target(cfg, model_cfg)
    out = Path(cfg.analysis.out) if cfg.analysis.out else output_dir(cfg) / "saliency"
    check_output(out)
    return model_cfg, resolve_device(cfg.get("device", "auto"), model_cfg), layer, head, out


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def _hydra_saliency(cfg: DictConfig) -> None:
    with logs.last_resort("spark-bench-saliency"):  # inside the task: @hydra.main catches exceptions itself
        _saliency(cfg)


def _saliency(cfg: DictConfig) -> None:
    try:
        model_cfg, device, layer, head, out = prepare(cfg)
        lm = load_model(model_cfg, device)
        samples = load_samples(cfg, lm)[:cfg.analysis.samples or None]
    except (ConfigError, FileNotFoundError, ValueError) as err:
        fail("spark-bench-saliency", cfg, err)
    LOG.info(f"{model_cfg.name}, {len(samples)} prompts of {cfg.benchmark.name} → {out}")
    run_saliency(lm, samples, cfg, layer, head, out)


def saliency() -> None:
    checked("spark-bench-saliency", _hydra_saliency)


def _memory_markdown(data: dict, paper: pd.DataFrame) -> str:
    from spark_bench.report.frame import clean_method

    from spark_bench.analysis.figures import peak_gib

    gib = 2 ** 30
    ours = {p["method"]: p for p in data["plans"]}
    at = {name: [peak_gib(p, b) for b in (32, 64)] for name, p in ours.items()}  # GiB at batch 32 and 64
    lines = [f"{data['model']}, {data['seq_len']} prompt + {data['gen_len']} generated tokens per sequence, "
             f"{data['cap_gib']:g} GiB; peak = weights + batch × KV per sequence (the planner's numbers, "
             "`spark-bench-memory`).", "",
             "| Method | KV GiB / sequence | GiB at batch 32 | GiB at batch 64 | max batch | paper: GB at 32 / 64, max "
             "batch |", "|---|---|---|---|---|---|"]
    for name, p in ours.items():
        theirs = paper[paper.method == clean_method(name)].set_index("column").value
        cited = (f"{theirs.get('batch 32', float('nan')):g} / {theirs.get('batch 64', float('nan')):g}, "
                 f"{theirs.get('max batch', float('nan')):g}") if len(theirs) else "–"
        lines.append(f"| {name} | {p['kv_bytes_per_sequence'] / gib:.3f} | {at[name][0]:.2f} | {at[name][1]:.2f} | "
                     f"{p['max_batch']} | {cited} |")
    lines.append("")
    for method, group in paper[paper.column.isin(["batch 32", "batch 64"])].groupby("method", sort=False):
        points = group.set_index("column").value.reindex(["batch 32", "batch 64"]).to_numpy()
        closest = min(at, key=lambda name: abs(np.asarray(at[name]) - points).sum())
        lines.append(f"The paper's {method} points ({points[0]:g} / {points[1]:g}) are closest to our {closest} "
                     f"({at[closest][0]:.2f} / {at[closest][1]:.2f} GiB).")
    lines.append("")
    full = paper[(paper.method == "Full") & paper.column.isin(["batch 32", "batch 64"])].set_index("column").value
    slope_gb = (full["batch 64"] - full["batch 32"]) / 32
    lines += [f"The paper does not state its sequence length; its full-cache points rise {slope_gb:.3f} GB per "
              f"sequence, {slope_gb * 1e9 / 131072:,.0f} tokens of LLaMA-3.1-8B's 128 KiB per token. Key-only SparK "
              "shrinks only the key half of the cache, so it cannot triple the batch (README, Speed and memory).", ""]
    return "\n".join(lines)


@logs.last_resort("spark-bench-figure2")
def figure2(argv: list[str] | None = None) -> None:
    """``spark-bench-figure2``: Fig. 2c (``--observation2 RUN_DIR``) and the appendix memory figure (``--memory
    JSON``) into ``--out``."""
    from spark_bench.analysis import figures
    from spark_bench.analysis.observation2 import loss_table, paper_frame, read_scores, to_markdown
    from spark_bench.report.frame import clean_method, read_paper_csv

    from spark_bench.commandline import ArgumentParser  # a bad flag: one line, exit 2

    parser = ArgumentParser(prog="spark-bench-figure2", description=figure2.__doc__)
    parser.add_argument("--observation2", type=Path, help="results directory of the Observation 2 sweep")
    parser.add_argument("--memory", type=Path, help="spark-bench-memory memory.out JSON (sweep=memory)")
    parser.add_argument("--out", type=Path, required=True)
    logs.add_flags(parser)
    args = parser.parse_args(argv)
    logs.configure(args.verbosity, "spark-bench-figure2")
    try:
        if not (args.observation2 or args.memory):
            raise ValueError("give --observation2 RUN_DIR and/or --memory JSON")
        for path in (args.observation2, args.memory):
            if path is not None and not path.exists():
                raise FileNotFoundError(f"{path}: no such file or directory")
        check_output(args.out)
        written = []
        if args.observation2:
            paper = paper_frame()
            table = loss_table(read_scores(args.observation2), paper)
            args.out.mkdir(parents=True, exist_ok=True)
            table.to_csv(args.out / "observation2.csv", index=False)
            (args.out / "observation2.md").write_text(to_markdown(table, paper), encoding="utf-8")
            written += ["observation2.md", "observation2.csv",
                        figures.loss_figure(table, args.out / "fig2c_relative_loss.png").name]
        if args.memory:
            data = json.loads(args.memory.read_text(encoding="utf-8"))
            plans, paper = data["plans"], read_paper_csv("fig_app_bsz_mem")
            seq_len, gen_len = data["seq_len"], data["gen_len"]
            theirs = {m: {"measured": {int(c.split()[1]): v for c, v in zip(g.column, g.value) if c.startswith("batch")},
                          "max_batch": float(g[g.column == "max batch"].value.iloc[0])}
                      for m, g in paper.groupby("method")}
            marks = {p["method"]: theirs[clean_method(p["method"])] for p in plans
                     if clean_method(p["method"]) in theirs}
            args.out.mkdir(parents=True, exist_ok=True)
            written.append(figures.memory_figure(plans, data["cap_gib"], seq_len + gen_len, marks,
                                                 args.out / "fig_app_batch_memory.png").name)
            (args.out / "memory.md").write_text(_memory_markdown(data, paper), encoding="utf-8")
            written.append("memory.md")
    except (ValueError, FileNotFoundError, KeyError, ConfigError) as err:
        print(f"spark-bench-figure2: error: {err}", file=sys.stderr)
        sys.exit(2)
    LOG.info(f"{', '.join(written)} → {args.out}")
