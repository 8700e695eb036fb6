"""LeanK's two-stage training (microsoft/MInference ``LeanK/train.py``), on one process and any supported model.

What it learns: one scale per layer, kv-head and key channel, ``s ∈ [0, 1]``. Each calibration example is a prompt
and its reference answer (teacher-forced, as LeanK's ``labels``). The prompt runs once through the unmodified model
(the *teacher*: dense attention, as LeanK's ``length_context`` part); the answer tokens then run twice from that
prompt cache: through the unmodified model, and through the *student*, whose answer queries attend every key
outside the dense region as ``k ∘ s`` (LeanK's ``scaled_attn``; the dense region is the first ``sink`` keys and
each query's last ``recent`` keys, float32 attention). The loss is LeanK's:

* ``distill``: the mean over answer tokens of the mean squared difference of the final hidden states (after the
  final norm: LeanK's ``outputs[0]`` of the decoder);
* ``+ reg_weight · mean |s|`` (LeanK's ``l1_loss``).

**Stage 1** trains the continuous scales from ``initial_value`` (clamped to [0, 1] before every step, and in the
forward). **Stage 2** starts from stage 1's scales and, every step, binarises them at the target ``ratio`` with
LeanK's alignment rule (:func:`~spark_bench.methods.channel.leank.align_mask`: one quantile threshold over every
layer and head, each head's count rounded to a multiple of ``align``, its largest scales kept); the kept channels
keep their scale, the others read 0, and the gradient passes through the mask to every scale (LeanK's
``BinaryMask``, a straight-through estimator). The final mask is that rule applied to the final scales. AdamW
(weight decay 0) and LeanK's learning-rate schedule (warm-up over the first fifth from 0.1, then 1, down to 0.1 over
the last fifth) in each stage.

A checkpoint (scales, stage 1's result, optimizer, scheduler, step, the log) is written every ``save_steps`` steps
and at each stage's end; a rerun with the same settings and examples resumes from it exactly (the example order is a
function of the step). Stage 1 does not read the target ratio (nor any of :data:`STAGE2_ONLY`), so masks at several
ratios can share one: :meth:`Trainer.start_from` begins stage 2 from another run's finished stage 1 (LeanK's own
stage 2 reloads stage 1's saved scales the same way, ``leank_train.stage1``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from spark_bench.methods.channel.leank import LeanKMask, align_mask, write_mask

ATTENTION_NAME = "spark_bench_leank_train"
CHECKPOINT = "checkpoint.pt"
MASK = "mask.json"
LOG = "train_log.json"
STAGE2_ONLY = ("ratio", "align", "stage2_steps", "stage2_lr", "stage2_reg_weight", "save_steps")  # unread by stage 1


@dataclass(frozen=True)
class Settings:
    """The training's options (``leank_train.*``; types and ranges in :data:`spark_bench.options.LEANK_TRAIN_OPTIONS`).
    Defaults: LeanK's Llama-3.1-8B scripts (``LeanK/scripts/llama3.1-8b.yaml``) and ``parse_args`` defaults."""

    ratio: float = 0.7
    align: int = 32
    stage1_steps: int = 2000
    stage2_steps: int = 200
    stage1_lr: float = 0.02
    stage2_lr: float = 0.01
    reg_weight: float = 0.06
    stage2_reg_weight: float = 0.0
    initial_value: float = 1.0
    sink: int = 128
    recent: int = 1024
    save_steps: int = 50
    seed: int = 42

    @classmethod
    def from_mapping(cls, values) -> "Settings":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in dict(values).items() if k in names})


@dataclass(frozen=True)
class Example:
    """A calibration example: the prompt's and the reference answer's token ids."""

    id: str
    prompt: tuple[int, ...]
    answer: tuple[int, ...]


def examples_of(samples, tokenizer) -> list[Example]:
    """Each sample with a reference answer as an :class:`Example` (its answer as the fidelity pass forces it,
    :func:`spark_bench.benchmarks.reference.reference_ids`); ValueError when none has one."""
    from spark_bench.benchmarks.reference import reference_ids

    out = [Example(s.id, tuple(s.input_ids), tuple(ids)) for s in samples for ids in [reference_ids(s, tokenizer)]
           if ids]
    if not out:
        raise ValueError("no calibration sample has a reference answer to distil on (benchmark.tasks / data_file)")
    return out


def scaled_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                     leank_scales=None, leank_sink: int = 128, leank_recent: int = 1024, **kwargs):
    """LeanK's ``scaled_attn`` for the last ``query.shape[-2]`` positions (the answer tokens, after a cached
    prompt): keys outside the dense region (the first ``leank_sink`` keys, each query's last ``leank_recent`` keys)
    enter as ``k ∘ scales[layer]``; causal; float32. Without ``leank_scales`` it is transformers' sdpa."""
    if leank_scales is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    b, hq, m, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    scale = scaling if scaling is not None else d ** -0.5
    q = query.float().reshape(b, hkv, hq // hkv, m, d)
    k, v = key.float().unsqueeze(2), value.float().unsqueeze(2)
    factors = leank_scales[module.layer_idx].float().view(1, hkv, 1, 1, d)
    full = q @ k.transpose(-1, -2)
    scaled = q @ (k * factors).transpose(-1, -2)
    q_pos = torch.arange(s - m, s, device=query.device).unsqueeze(-1)
    k_pos = torch.arange(s, device=query.device)
    dense = (k_pos < leank_sink) | (q_pos - k_pos < leank_recent)
    logits = torch.where(dense, full, scaled) * scale
    logits = logits.masked_fill(k_pos > q_pos, float("-inf"))
    out = torch.softmax(logits, dim=-1) @ v
    return out.reshape(b, hq, m, d).transpose(1, 2).to(query.dtype), None


AttentionInterface.register(ATTENTION_NAME, scaled_attention)


class _BinaryMask(torch.autograd.Function):
    """LeanK's ``BinaryMask``: the kept scales forward, 0 elsewhere; the gradient to every scale (straight through)."""

    @staticmethod
    def forward(ctx, x, mask):
        return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _short(x: float) -> float:
    """Six significant digits, for the log."""
    return float(f"{x:.6g}")


def _cache_of(kv) -> DynamicCache:
    """A fresh cache holding the prompt's keys and values (the answer's are appended to it, not to ``kv``)."""
    cache = DynamicCache()
    for i, (keys, values) in enumerate(kv):
        cache.update(keys, values, i)
    return cache


def load_checkpoint(path: Path) -> dict:
    """A checkpoint this trainer wrote (tensors and strings only: ``weights_only``)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def stage1_refusal(path: Path, state: dict, ours: dict) -> str | None:
    """Why stage 2 cannot start from the checkpoint ``state`` read from ``path`` (None: it can): its stage 1 is
    unfinished, or made with other stage-1 settings (every key but :data:`STAGE2_ONLY`) or another model shape or
    other calibration samples than ``ours`` (a fingerprint; only its keys are compared: ``{"settings": …}`` before
    the model loads, the whole one after)."""
    if state.get("stage1_scales") is None:
        return (f"leank_train.stage1: {path} has not finished stage 1 (stage {state['stage']}, step {state['step']}); "
                "let that run finish its stage 1 first")
    theirs = json.loads(state["fingerprint"])
    differ = [f"{k}={v!r}" for k, v in theirs["settings"].items()
              if k not in STAGE2_ONLY and ours["settings"].get(k) != v]
    differ += [f"another {k}" for k in ours if k != "settings" and theirs.get(k) != ours[k]]
    return (f"leank_train.stage1: {path}'s stage 1 was made with {', '.join(differ)}; stage 2 starts only from a "
            "stage 1 with the same settings and samples") if differ else None


def lr_factor(total: int):
    """LeanK's schedule (``LambdaLR``): ``min(1, max((t+1)/(N//5), 0.1), max((N−t)/(N//5), 0.1))``; ``N//5`` is at
    least 1 here (LeanK's divides by zero below 5 steps)."""
    fifth = max(total // 5, 1)
    return lambda step: min(1.0, max((step + 1) / fifth, 0.1), max((total - step) / fifth, 0.1))


class Trainer:
    """The two stages on ``model`` (a causal LM of transformers) over ``examples``, checkpointing into ``out``."""

    def __init__(self, model, examples: list[Example], settings: Settings, out: Path, model_name: str = "",
                 progress: bool = False, cache_teacher: bool = True, log=None):
        self.model, self.examples, self.settings, self.out = model, examples, settings, Path(out)
        self.model_name, self.progress, self.cache_teacher = model_name, progress, cache_teacher
        self.log = log or (lambda text: None)
        config = model.config
        self.shape = (config.num_hidden_layers, getattr(config, "num_key_value_heads", config.num_attention_heads),
                      getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.device = next(model.parameters()).device
        self._teacher: dict[str, tuple] = {}
        self.stage, self.step, self.history = 1, 0, []
        self.stage1_scales: torch.Tensor | None = None
        self.scales = torch.nn.Parameter(torch.full(self.shape, float(settings.initial_value), device=self.device))
        self._new_optimizer()

    # ---- state --------------------------------------------------------------------------------------------------
    def _new_optimizer(self) -> None:
        s = self.settings
        lr, steps = (s.stage1_lr, s.stage1_steps) if self.stage == 1 else (s.stage2_lr, s.stage2_steps)
        self.optimizer = torch.optim.AdamW([self.scales], lr=lr, weight_decay=0.0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(steps))

    def _fingerprint(self) -> dict:
        return {"settings": asdict(self.settings), "shape": list(self.shape),
                "examples": [[e.id, len(e.prompt), len(e.answer)] for e in self.examples]}

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / CHECKPOINT
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"fingerprint": json.dumps(self._fingerprint(), sort_keys=True), "stage": self.stage,
                    "step": self.step, "scales": self.scales.detach().cpu(), "stage1_scales": self.stage1_scales,
                    "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                    "history": json.dumps(self.history)}, tmp)
        os.replace(tmp, path)

    def start_from(self, checkpoint: Path) -> None:
        """Begin at stage 2, step 0, from the stage 1 another run finished (its ``checkpoint.pt``): ValueError when
        its stage 1 is unfinished or was made with other stage-1 settings, model shape or calibration samples
        (:func:`stage1_refusal`)."""
        state = load_checkpoint(checkpoint)
        refusal = stage1_refusal(checkpoint, state, self._fingerprint())
        if refusal:
            raise ValueError(refusal)
        self.stage, self.step = 2, 0
        self.stage1_scales = state["stage1_scales"]
        with torch.no_grad():
            self.scales.copy_(self.stage1_scales.to(self.device))
        self.history = [h for h in json.loads(state["history"]) if h["stage"] == 1]
        self._new_optimizer()
        self.save()

    def resume(self) -> bool:
        """Continue from ``out``'s checkpoint when there is one (True); ValueError when it was made with other
        settings or examples."""
        path = self.out / CHECKPOINT
        if not path.is_file():
            return False
        state = load_checkpoint(path)
        if state["fingerprint"] != json.dumps(self._fingerprint(), sort_keys=True):
            raise ValueError(f"{path} was made with other leank_train settings or calibration samples; rerun with "
                             "those, or choose another leank_train.out")
        self.stage, self.step = int(state["stage"]), int(state["step"])
        self.stage1_scales = state["stage1_scales"]
        with torch.no_grad():
            self.scales.copy_(state["scales"].to(self.device))
        self._new_optimizer()
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.history = json.loads(state["history"])
        return True

    # ---- one step -----------------------------------------------------------------------------------------------
    def _decoder(self):
        return self.model.base_model

    @torch.no_grad()
    def teacher(self, example: Example):
        """The prompt's keys and values per layer (dense) and the answer tokens' final hidden states through the
        unmodified model."""
        if example.id in self._teacher:
            return self._teacher[example.id]
        prompt = torch.tensor([example.prompt], device=self.device)
        answer = torch.tensor([example.answer], device=self.device)
        cache = self._decoder()(input_ids=prompt, use_cache=True).past_key_values
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        hidden = self._decoder()(input_ids=answer, past_key_values=_cache_of(kv), use_cache=True).last_hidden_state
        if self.cache_teacher:
            self._teacher[example.id] = (kv, hidden)
        return kv, hidden

    def example_at(self, stage: int, step: int) -> Example:
        """The example of a step: a seeded permutation per pass over the examples (LeanK's shuffled loader)."""
        n = len(self.examples)
        order = np.random.default_rng([self.settings.seed, stage, step // n]).permutation(n)
        return self.examples[int(order[step % n])]

    def train_step(self) -> dict:
        s = self.settings
        example = self.example_at(self.stage, self.step)
        with torch.no_grad():
            self.scales.clamp_(0, 1)
        factors = self.scales.clamp(0, 1)
        kept = None
        if self.stage == 2:
            kept = align_mask(self.scales.detach(), s.ratio, s.align).to(self.device)
            factors = _BinaryMask.apply(factors, kept)
        kv, target = self.teacher(example)
        config = self.model.config
        previous = config._attn_implementation
        config._attn_implementation = ATTENTION_NAME
        try:
            hidden = self._decoder()(input_ids=torch.tensor([example.answer], device=self.device),
                                     past_key_values=_cache_of(kv), use_cache=True, leank_scales=factors,
                                     leank_sink=s.sink, leank_recent=s.recent).last_hidden_state
        finally:
            config._attn_implementation = previous
        distill = (target.float() - hidden.float()).pow(2).mean(-1).mean()
        reg = self.scales.abs().mean()
        weight = s.reg_weight if self.stage == 1 else s.stage2_reg_weight
        loss = distill + weight * reg
        loss.backward()
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        record = {"stage": self.stage, "step": self.step, "sample": example.id, "distill": _short(distill.item()),
                  "reg": _short(reg.item()), "loss": _short(loss.item()), "lr": _short(lr)}
        if kept is not None:
            record["kept"] = _short(kept.float().mean().item())
        self.history.append(record)
        return record

    # ---- the run ------------------------------------------------------------------------------------------------
    def run(self) -> LeanKMask:
        """Both stages from where the checkpoint left off; the final mask (also written, with the log)."""
        from tqdm import tqdm

        s = self.settings
        for p in self.model.parameters():
            p.requires_grad_(False)
        total = s.stage1_steps + s.stage2_steps
        done = self.step + (s.stage1_steps if self.stage == 2 else 0)
        start = time.perf_counter()
        with tqdm(total=total, initial=min(done, total), disable=not self.progress, desc="LeanK",
                  dynamic_ncols=True) as bar:
            while self.stage == 1 or (self.stage == 2 and self.step < s.stage2_steps):
                if self.stage == 1 and self.step >= s.stage1_steps:
                    self.stage1_scales = self.scales.detach().cpu().clone()
                    self.stage, self.step = 2, 0
                    self._new_optimizer()
                    self.save()
                    continue
                r = self.train_step()
                bar.set_description(f"LeanK stage {r['stage']}")
                bar.set_postfix_str(f"Dloss={r['distill']:.3g} Rloss={r['reg']:.3g} LR={r['lr']:.2e}")
                bar.update(1)
                limit = s.stage1_steps if self.stage == 1 else s.stage2_steps
                if self.step % s.save_steps == 0 or self.step == limit:
                    self.save()
        self.save()
        seconds = time.perf_counter() - start
        mask = LeanKMask(align_mask(self.scales.detach(), s.ratio, s.align), s.align)
        self.write(mask, seconds)
        return mask

    def write(self, mask: LeanKMask, seconds: float) -> None:
        """``mask.json`` (the mask ``leank.mask=`` names) and ``train_log.json`` (settings, examples, every step)."""
        counts = mask.counts()
        summary = {"model": self.model_name, "target_ratio": self.settings.ratio, "ratio": round(mask.ratio, 6),
                   "align": mask.align, "samples": len(self.examples),
                   "steps": [self.settings.stage1_steps, self.settings.stage2_steps]}
        write_mask(mask, self.out / MASK, model=self.model_name, target_ratio=self.settings.ratio,
                   trained={k: v for k, v in summary.items() if k not in ("model", "ratio", "align")})
        kinds, how_many = counts.flatten().unique(return_counts=True)
        log = {**summary, "settings": asdict(self.settings), "seconds_this_session": round(seconds, 1),
               "heads_by_kept_channels": {str(int(k)): int(n) for k, n in zip(kinds, how_many)},
               "examples": [{"id": e.id, "prompt_tokens": len(e.prompt), "answer_tokens": len(e.answer)}
                            for e in self.examples],
               "history": self.history}
        (self.out / LOG).write_text(json.dumps(log, indent=1) + "\n", encoding="utf-8")
