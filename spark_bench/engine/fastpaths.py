"""Fast paths checked against their reference at run time (issue 42, item 4).

A decode batch computes attention on a *fast path*: the C++ kernels over a stacked batch on the CPU, the fused Triton
kernel on CUDA (:class:`~spark_bench.engine.cache.BatchedLayer`), and on CUDA it may replay each step from a captured
graph (:class:`~spark_bench.engine.decode.StepGraph`). A compiler difference on a new GPU, or a capture that reads a
stale length, would silently change every score. So at the first use of each *variant* in a run — each kernel
specialisation (backend, dtype, head dim, heads per work item, single-token step or suffix) and each captured graph's
width — the fast path's output is compared with its reference on the same inputs:

* a kernel: the attention of every row whose stores the kernels serve, recomputed with the keys rebuilt in float32
  (the recovered entries as the kernels compute them), a float32 softmax over prompt and decoded tail and the merge of
  the two (:class:`~spark_bench.engine.cache.Partial`);
* a graph: its first replay's logits against an eager step over the same inputs (the step is rewound and run again).

The error is ``max |fast − reference| / max |reference|`` over the compared tensor; the tolerance is stated per dtype in
:data:`TOLERANCE` (4 roundings of the output's dtype — the fast kernel's output is rounded to the model dtype once — and
``1e-4`` in float32, where only the summation order differs). A mismatch warns once (a ``spark_bench`` log line, so
``run.log`` has it), and the run continues on the reference path: kernels off (attention as ``attention=materialize``:
keys rebuilt, plain float32 matmuls) or graphs off (eager steps). :meth:`FastPaths.record` is what the run writes to
its ``manifest.json`` and the report prints: which path produced the numbers. The first use of each variant — its
compile and its check — is timed apart (:attr:`FastPaths.seconds`, the rows' ``warmup_s``), not in the decode
throughput.

A run's record is one :class:`FastPaths` object, passed down explicitly: a sweep
(:func:`spark_bench.runner.run_sweep`) makes one and hands it to every decode batch and scoring pass of the run
(``checks=`` / ``fast_paths=``), so each variant is checked once per run and a fallback holds for the rest of it;
``scripts/gpu/check.py`` makes one for the check, a :func:`spark_bench.press` block and the lm-eval model
(:mod:`spark_bench.lm_eval_model`) one each. A call given none (:func:`spark_bench.generate`,
:func:`~spark_bench.engine.decode.decode_rows`, a :class:`~spark_bench.engine.cache.BatchedCache`) is a run of its
own with a new record: no state is kept between calls or shared across a process. A caller that wants one record
over several calls passes the same object to each (``checks=``; ``fast_paths=`` for a cache).
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

LOG = logging.getLogger(__name__)

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 4 * 2 ** -8, torch.float16: 4 * 2 ** -11}
REFERENCE = {"kernel": "keys rebuilt, float32 matmuls and softmax (attention=materialize)",
             "graph": "eager decode steps"}
FAST = {"kernel": "the compact kernels", "graph": "CUDA graphs"}


def tolerance(dtype: torch.dtype) -> float:
    """The largest normalised error accepted for an output of ``dtype`` (:data:`TOLERANCE`)."""
    return TOLERANCE.get(dtype, 1e-4)


def normalised_error(fast: torch.Tensor, reference: torch.Tensor) -> float:
    """``max |fast − reference| / max |reference|`` in float32 (inf when either holds a NaN or an inf)."""
    fast, reference = fast.float(), reference.float()
    if not (bool(torch.isfinite(fast).all()) and bool(torch.isfinite(reference).all())):
        return float("inf")
    scale = float(reference.abs().max()) if reference.numel() else 0.0
    diff = float((fast - reference).abs().max()) if reference.numel() else 0.0
    return diff / scale if scale > 0 else diff


@dataclass
class Check:
    kind: str        # "kernel" or "graph"
    variant: str     # what was checked (the specialisation, or the graph's width)
    error: float     # normalised_error(fast, reference)
    tolerance: float
    ok: bool
    seconds: float   # the first use's time: compile (on a first launch), the fast output and the reference


@dataclass
class FastPaths:
    """One run's record of its fast paths: what was checked at first use, what was switched off after a mismatch,
    and the time the first uses took. ``enabled=False`` checks nothing (the fast paths run unchecked)."""

    enabled: bool = True
    checks: dict = field(default_factory=dict)   # variant → Check
    off: dict = field(default_factory=dict)      # kind → the variant whose mismatch switched it off
    seconds: float = 0.0

    def due(self, variant: str) -> bool:
        """Whether ``variant`` is to be checked now: its first use in the run (never inside a graph capture)."""
        if not self.enabled or variant in self.checks:
            return False
        return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())

    def on(self, kind: str) -> bool:
        """Whether ``kind`` (``kernel`` / ``graph``) may still run (no mismatch so far)."""
        return kind not in self.off

    @contextmanager
    def timed(self, tensor: torch.Tensor):
        """Adds the block's wall time to :attr:`seconds`, the device drained before and after (``tensor``'s)."""
        _drain(tensor)
        start = time.perf_counter()
        try:
            yield
        finally:
            _drain(tensor)
            self.seconds += time.perf_counter() - start

    def judge(self, kind: str, variant: str, fast: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype,
              seconds: float = 0.0) -> bool:
        """Record the comparison of ``fast`` with ``reference`` (an output of ``dtype``); on a mismatch, warn (once
        per kind: the kind is off from then on) and return False: the caller uses the reference's output."""
        error, tol = normalised_error(fast, reference), tolerance(dtype)
        ok = error <= tol
        self.checks[variant] = Check(kind, variant, error, tol, ok, seconds)
        if not ok and kind not in self.off:
            self.off[kind] = variant
            LOG.warning(f"warning: fast path {variant} differs from its reference (error {error:.2e} of the output's "
                        f"scale > tolerance {tol:.1e}); this run continues without {FAST[kind]}: "
                        f"{REFERENCE[kind]}")
        return ok

    def summary(self) -> str:
        """One line: which path produced the numbers."""
        if not self.enabled:
            return "fast paths unchecked (FastPaths(enabled=False))"
        if not self.checks:
            return "no fast path used (per-row reference attention)"
        parts = []
        for kind in ("kernel", "graph"):
            mine = [c for c in self.checks.values() if c.kind == kind]
            if not mine:
                continue
            if kind in self.off:
                bad = self.checks[self.off[kind]]
                parts.append(f"{REFERENCE[kind]} after {bad.variant} differed from it (error {bad.error:.1e} > "
                             f"{bad.tolerance:.0e})")
            else:
                worst = max(c.error / c.tolerance for c in mine)
                parts.append(f"{FAST[kind]} ({len(mine)} variant{'s' * (len(mine) > 1)} checked against the "
                             f"reference at first use, worst error {worst:.2f}× its tolerance)")
        return "numbers from " + "; ".join(parts)

    def record(self) -> dict:
        """What the manifest keeps: the summary line, each check, what was switched off, the first uses' time."""
        return {"numbers_from": self.summary(), "enabled": self.enabled, "fallbacks": dict(self.off),
                "checks": [asdict(c) for c in self.checks.values()], "warmup_s": round(self.seconds, 4)}


def _drain(tensor: torch.Tensor) -> None:
    if tensor.device.type == "cuda":
        torch.cuda.synchronize(tensor.device)
