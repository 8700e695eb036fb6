"""The motivation figures as PNGs (matplotlib, no display): Fig. 2a (3D surface of per-token channel contributions),
Fig. 2b (per-channel CV), Appendix B (token patterns, 3D scatter, heatmap), Fig. 2c (relative loss of structured /
unstructured pruning, the constant substitution and recovery) and the appendix's batch-size/memory figure."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from spark_bench.report.figures import pyplot, save


def _rows(c: np.ndarray, most: int) -> np.ndarray:
    """At most ``most`` evenly spaced token indices (a 3D plot of thousands of rows shows nothing more)."""
    return np.unique(np.linspace(0, c.shape[0] - 1, min(most, c.shape[0])).round().astype(int))


def _grid3d(c: np.ndarray, most: int, title: str):
    """A 3D axes over (token, channel) for at most ``most`` tokens: (figure, axes, token grid, channel grid,
    values)."""
    rows = _rows(c, most)
    tokens, channels = np.meshgrid(rows, np.arange(c.shape[1]), indexing="ij")
    fig = pyplot().figure(figsize=(7, 5.5))
    ax = fig.add_subplot(projection="3d")
    ax.set(xlabel="token", ylabel="channel", zlabel="|q̄_j·k_tj|", title=title)
    return fig, ax, tokens, channels, c[rows]


def surface(c: np.ndarray, title: str, path: Path) -> Path:
    """Fig. 2a: contribution over (token, channel) as a surface."""
    fig, ax, tokens, channels, values = _grid3d(c, 160, title)
    ax.plot_surface(tokens, channels, values, cmap="viridis", linewidth=0, antialiased=False)
    return save(fig, path)


def scatter(c: np.ndarray, title: str, path: Path) -> Path:
    """Appendix B: the same contributions as a 3D scatter coloured by value."""
    fig, ax, tokens, channels, values = _grid3d(c, 200, title)
    ax.scatter(tokens.ravel(), channels.ravel(), values.ravel(), c=values.ravel(), cmap="viridis", s=2)
    return save(fig, path)


def heatmap(c: np.ndarray, title: str, path: Path) -> Path:
    """Appendix B: channels × tokens, each token's contributions normalised by its largest (what matters for a
    per-token top-T is the order within the token)."""
    plt = pyplot()
    share = c / np.maximum(c.max(axis=1, keepdims=True), 1e-30)
    fig, ax = plt.subplots(figsize=(10, 4))
    image = ax.imshow(share.T, aspect="auto", cmap="magma", interpolation="nearest")
    ax.set(xlabel="token", ylabel="channel", title=title)
    fig.colorbar(image, ax=ax, label="contribution / token's largest")
    return save(fig, path)


def token_patterns(c: np.ndarray, title: str, path: Path, count: int = 6) -> Path:
    """Appendix B: per-channel contributions of ``count`` representative tokens (evenly spaced over the prompt)."""
    plt = pyplot()
    rows = _rows(c, count)
    fig, axes = plt.subplots(1, len(rows), figsize=(3 * len(rows), 2.8), sharey=False)
    for ax, t in zip(np.atleast_1d(axes), rows):
        ax.bar(np.arange(c.shape[1]), c[t], color=pyplot().cm.viridis(c[t] / max(c[t].max(), 1e-30)))
        ax.set(title=f"token {t}", xlabel="channel")
    fig.suptitle(title)
    return save(fig, path)


def cv_figure(cv_head: np.ndarray, cv_all: np.ndarray, title: str, path: Path, paper_cv: float = 1.1) -> Path:
    """Fig. 2b: the chosen head's CV per channel (with its mean and the paper's 1.1), and the distribution of every
    layer's and head's per-channel CVs."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6))
    left.bar(np.arange(len(cv_head)), cv_head, color="tab:blue")
    left.axhline(np.nanmean(cv_head), color="tab:orange", label=f"mean {np.nanmean(cv_head):.2f}")
    left.axhline(paper_cv, color="tab:red", linestyle="--", label=f"paper: > {paper_cv}")
    left.set(xlabel="channel", ylabel="CV across tokens", title=title)
    left.legend()
    values = cv_all[np.isfinite(cv_all)].ravel()
    right.hist(values, bins=60, color="tab:blue")
    right.axvline(values.mean(), color="tab:orange", label=f"mean {values.mean():.2f}")
    right.axvline(paper_cv, color="tab:red", linestyle="--", label=f"paper: > {paper_cv}")
    right.set(xlabel="CV across tokens (every layer, kv-head, channel)", ylabel="channels", title="all heads")
    right.legend()
    return save(fig, path)


def loss_figure(table: pd.DataFrame, path: Path) -> Path:
    """Fig. 2c: relative loss (%) against the full cache per method and λ, ours (bars with 95% intervals) beside
    the paper's numbers where it gives them (hollow markers). ``table``: :func:`~.observation2.loss_table`."""
    plt = pyplot()
    tasks = [t for t in dict.fromkeys(table.task) if t != "Avg."] + ["Avg."]
    methods = list(dict.fromkeys(table.method))
    ratios = sorted(table.ratio.unique())
    fig, axes = plt.subplots(1, len(ratios), figsize=(5.5 * len(ratios), 3.8), sharey=True)
    width = 0.8 / len(methods)
    for ax, ratio in zip(np.atleast_1d(axes), ratios):
        for k, method in enumerate(methods):
            part = table[(table.ratio == ratio) & (table.method == method)].set_index("task").reindex(tasks)
            x = np.arange(len(tasks)) + (k - (len(methods) - 1) / 2) * width
            err = np.vstack([part.loss - part.low, part.high - part.loss])
            ax.bar(x, part.loss, width, yerr=err, capsize=2, label=method)
            if part.paper.notna().any():
                ax.scatter(x, part.paper, marker="o", facecolors="none", edgecolors="black", zorder=3,
                           label="paper" if k == 0 else None)
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xticks(np.arange(len(tasks)), tasks, rotation=20)
        ax.set(title=f"λ = {ratio:g}", ylabel="relative loss vs full cache (%)")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    return save(fig, path)


def peak_gib(plan: dict, batch):
    """The planner's peak for ``batch`` sequences (a number or an array): weights + batch × KV per sequence, in
    GiB (``plan``: one of ``spark-bench-memory``'s JSON plans)."""
    return (plan["weights_bytes"] + batch * plan["kv_bytes_per_sequence"]) / 2 ** 30


def memory_figure(plans: list[dict], cap_gib: float, seq_len: int, paper: dict, path: Path) -> Path:
    """The appendix's batch size and memory: peak GiB against batch size per method (weights + batch × KV per
    sequence, the planner's numbers) up to the cap, the largest batch in the legend; the paper's measured points
    (``paper``: method → {batch: GB}) and its largest batches as markers."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for plan in plans:
        batches = np.arange(0, plan["max_batch"] + 1)
        line, = ax.plot(batches, peak_gib(plan, batches), label=f"{plan['method']}: max batch {plan['max_batch']}")
        points = paper.get(plan["method"])
        if points:
            ax.scatter(list(points["measured"]), list(points["measured"].values()), color=line.get_color(),
                       marker="o", facecolors="none", zorder=3)
            ax.axvline(points["max_batch"], color=line.get_color(), linestyle=":", linewidth=1)
    ax.axhline(cap_gib, color="black", linestyle="--", linewidth=0.8, label=f"{cap_gib:g} GiB")
    ax.set(xlabel="batch size (sequences)", ylabel="peak memory (GiB)",
           title=f"weights + KV at {seq_len} tokens per sequence (hollow / dotted: the paper's)")
    ax.legend(fontsize=7)
    return save(fig, path)
