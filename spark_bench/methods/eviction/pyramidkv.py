"""PyramidKV (Cai et al., 2024): SnapKV scoring with per-layer budgets on a linear ramp (more tokens low down).

Budget ramp, original PyramidKV code (KVCache-Factory ``PyramidKVCluster``), with ``B`` the requested budget in
tokens, ``W`` the window, ``L`` layers and ``β = 20``::

    min_num = (B − W) // β ;  max_num = 2(B − W) − min_num
    if max_num ≥ S − W:  max_num = S − W ;  min_num = 2(B − W) − max_num
    steps = (max_num − min_num) // (L − 1)
    layer l keeps  max_num − l·steps  scored tokens  +  the W window tokens

so the layers average ``B`` (up to the floor in ``steps``). When the prompt is short (``S < 2(B − W)``) the
original code keeps ``B`` tokens in every layer, like SnapKV (``fallback=original``, the default).

``fallback=keep90`` reproduces the official SparK fork instead: whenever the ramp is infeasible
(not ``S ≥ max_num ≥ min_num ≥ W``, e.g. small budgets where ``(B − W) // β < W``) every layer keeps 90% of the
prompt. The paper's PyramidKV rows at KV 128–1024 are identical, which is what this fallback produces.

``fallback=kvpress`` is the whole budget rule of the fork's ``PyramidKVPress.get_layer_budget`` (kvpress 0.2.9),
not only its fallback: capacity ``C = min(B, S)`` for a token budget (``W + S·f`` for a fraction ``f``), float
``min_num = (C − W)/β``, ``max_num = 2(C − W) − min_num``, the same clamp to ``S − W``, float steps and
``round(max_num − l·steps)`` tokens per layer *with the window counted inside* (so layers average ``B − W``);
when not ``S ≥ max_num ≥ min_num ≥ W`` every layer keeps ``round(S·(1 − r))`` with ``r`` = eval.py's default
compression ratio 0.1 for token budgets (90%) and ``1 − f`` for fractions.
"""

from __future__ import annotations

from dataclasses import dataclass

from spark_bench.methods.base import resolve_budget
from spark_bench.methods.eviction.snapkv import SnapKV

FALLBACKS = ("original", "keep90", "kvpress")
KVPRESS_TOKEN_BUDGET_RATIO = 0.1  # eval.py's default compression_ratio, used by the fallback for token budgets


def pyramid_budgets(budget: int, prompt_length: int, window: int, num_layers: int, beta: int = 20,
                    fallback: str = "original") -> list[int]:
    """Tokens kept by each layer (window included), see the module docstring."""
    if fallback not in FALLBACKS:
        raise ValueError(f"pyramid_fallback must be one of {FALLBACKS}, got {fallback!r}")
    s, b, w = prompt_length, budget, window
    if s <= b:
        return [s] * num_layers
    min_num = (b - w) // beta
    max_num = 2 * (b - w) - min_num
    if max_num >= s - w:
        max_num = s - w
        min_num = 2 * (b - w) - max_num
    if fallback == "keep90":
        if not s >= max_num >= min_num >= w:
            return [round(0.9 * s)] * num_layers
    elif s < 2 * (b - w):
        return [b] * num_layers
    steps = (max_num - min_num) // max(num_layers - 1, 1)
    return [max_num - layer * steps + w for layer in range(num_layers)]


def kvpress_budgets(budget: float, prompt_length: int, window: int, num_layers: int, beta: int = 20) -> list[int]:
    """Tokens kept by each layer under ``fallback=kvpress`` (window included), see the module docstring."""
    s, w = prompt_length, window
    if budget >= 1:
        capacity, ratio = min(int(budget), s), KVPRESS_TOKEN_BUDGET_RATIO
    else:
        capacity, ratio = w + s * budget, 1 - budget
    min_num = (capacity - w) / beta
    max_num = (capacity - w) * 2 - min_num
    if max_num >= s - w:
        max_num = s - w
        min_num = (capacity - w) * 2 - max_num
    if not s >= max_num >= min_num >= w:
        return [round(s * (1 - ratio))] * num_layers
    steps = (max_num - min_num) / max(num_layers - 1, 1)
    return [round(max_num - layer * steps) for layer in range(num_layers)]


@dataclass(frozen=True)
class PyramidKV(SnapKV):
    beta: int = 20
    fallback: str = "original"

    def __post_init__(self):
        super().__post_init__()
        if self.fallback not in FALLBACKS:
            raise ValueError(f"pyramid_fallback must be one of {FALLBACKS}, got {self.fallback!r}")

    def layer_budget(self, prompt_length: int, layer_idx: int, num_layers: int) -> int:
        window = min(self.window_size, prompt_length)
        if self.fallback == "kvpress":
            ramp = kvpress_budgets(self.budget, prompt_length, window, num_layers, self.beta)
            return max(1, min(ramp[layer_idx], prompt_length))
        budget = resolve_budget(self.budget, prompt_length)  # its own rule; the fork's matches (no budget_rounding)
        ramp = pyramid_budgets(budget, prompt_length, window, num_layers, self.beta, self.fallback)
        return min(ramp[layer_idx], prompt_length)
