"""Optimizers and learning-rate schedules for drafter training: torch's, routed per parameter.

AdamW (`torch.optim.AdamW`) is the default. `train.optimizer: muon` puts the 2-D hidden weight
matrices on `torch.optim.Muon` (Jordan et al. 2024, "Muon: an optimizer for hidden layers":
orthogonalised Nesterov momentum by a Newton-Schulz iteration) and embeddings, output heads,
norms and vectors on AdamW. `adjust_lr_fn="match_rms_adamw"` scales the orthogonal update by
0.2 * sqrt(max(rows, cols)) (Moonshot, "Muon is Scalable for LLM Training", 2025) so its RMS
matches AdamW's and the same `train.lr` and `train.weight_decay` serve both.

What is specctl's own, and why (figures: `python -m benchmarks.perf --only optim`, docs/performance.md):
- `MuonAdamW` only routes: torch.optim.Muon refuses any parameter that is not 2-D and torch has
  no hybrid, so without it a Muon run needs two optimizers, two schedulers and two state dicts in
  every checkpoint. It is one `torch.optim.Optimizer` whose groups and state are shared with the
  two torch optimizers doing the math, so DCP checkpoints (world-size independent), the LR
  scheduler and resume see one optimizer. specctl's earlier hand-written Muon ran the iteration
  in float32 on CPU; torch's runs it in bfloat16: 3.8-5.3x faster per step on a 2-core Xeon with
  AMX, its update within 1.1 % of the float32 one. Under FSDP2 it runs on the DTensor shards
  (no gather), so a sharded run matches a one-rank run to bf16 precision, not float32's.
- `Float32Muon`, on a CPU without native bf16 only: torch's iteration hard-codes bfloat16, which
  such a CPU emulates. On a 2-core AMD EPYC with AVX2 alone a DFlash quickstart step with torch's
  Muon ran at 44 training tokens/s against 1,500 with AdamW; the same math in float32 is what
  `Float32Muon` runs there (torch's own loop, its Newton-Schulz in float32).
- AdamW runs torch's fused kernel (`fused=True`) wherever torch has one for the parameters'
  device (CPU, CUDA): one pass over each tensor, not a dozen elementwise kernels. The step of
  a quickstart drafter's AdamW on one CPU thread: DFlash 38.9 -> 11.0 ms, DSpark (its Markov
  embedding spans the verifier's vocabulary) 58.4 -> 15.9 ms, about 10% of DSpark's whole
  training step. The same math; torchtitan defaults to it too.
- The schedule is torch's (LinearLR warmup, then CosineAnnealingLR / LinearLR / ConstantLR,
  chained by SequentialLR): it matches the closed form documented in `lr_at` to 1e-13 of the
  peak. transformers' schedulers do not: `get_cosine_with_min_lr_schedule_with_warmup` starts at
  LR 0 (a wasted first step) and `get_linear_schedule_with_warmup` decays to 0, not to
  `train.min_lr_ratio`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim import lr_scheduler

from specctl.devices import native_bf16
from specctl.recipe import TrainSection


def lr_at(
    step: int, peak: float, warmup_steps: int, max_steps: int, schedule: str, min_lr_ratio: float
) -> float:
    """The schedule `build_scheduler` runs, in closed form: the LR of optimizer step `step` (0-based).

    Linear warmup reaches `peak` at step `warmup_steps - 1`; cosine and linear then fall to
    `peak * min_lr_ratio` at the last step (`max_steps - 1`); constant stays at the peak.
    """
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if schedule == "constant":
        return peak
    decay_steps = max(1, max_steps - 1 - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif schedule == "linear":
        shape = 1.0 - progress
    else:
        raise ValueError(f"unknown schedule {schedule!r}; use cosine, linear or constant")
    return peak * (min_lr_ratio + (1.0 - min_lr_ratio) * shape)


def newton_schulz_fp32(
    G: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz orthogonalisation of G [m, n], in float32 (torch's
    runs in bfloat16): the same coefficients, normalisation and order of products."""
    a, b, c = coefficients
    tall = G.shape[0] > G.shape[1]
    X = G.float().T if tall else G.float()  # [min, max]: the Gram matrix is the small side
    X = X / X.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = X @ X.T
        X = torch.addmm(X, torch.addmm(gram, gram, gram, beta=b, alpha=c), X, beta=a)
    return X.T if tall else X


def muon_lr_ratio(adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch.optim.Muon's per-matrix LR scale (`adjust_lr_fn`), for `Float32Muon`."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return 1.0


def closure_loss(closure) -> Any:
    """The loss of an optimizer's `step(closure)` (None without one), evaluated with gradients on."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class Float32Muon(torch.optim.Muon):
    """torch.optim.Muon with its Newton-Schulz iteration in float32, for CPUs that emulate bf16.

    Same groups, defaults and state (`momentum_buffer`) as torch's, so a checkpoint resumes on
    either; the step is torch's single-tensor loop (decoupled weight decay, Nesterov momentum by
    lerp, the update scaled by `muon_lr_ratio`).
    """

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = closure_loss(closure)
        for group in self.param_groups:
            lr, momentum = float(group["lr"]), group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = newton_schulz_fp32(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update.to(p.dtype), alpha=-lr * muon_lr_ratio(group["adjust_lr_fn"], p.shape))
        return loss


def muon_class(device: torch.device) -> type[torch.optim.Muon]:
    """torch's Muon where bf16 is native, `Float32Muon` where it would be emulated."""
    return torch.optim.Muon if native_bf16(device) else Float32Muon


FUSED_ADAMW_DEVICES = ("cpu", "cuda")  # where torch.optim.AdamW(fused=True) has its kernel


def adamw(
    groups: list[dict], lr: float, betas: tuple[float, float], weight_decay: float
) -> torch.optim.AdamW:
    """torch.optim.AdamW, fused when every parameter is a float tensor on a device with the kernel
    (DTensor shards under FSDP2 too); elsewhere torch's default implementation."""
    params = [p for g in groups for p in g["params"]]
    fused = all(p.is_floating_point() and p.device.type in FUSED_ADAMW_DEVICES for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, weight_decay=weight_decay, fused=fused or None)


class MuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon on the param groups with `use_muon=True`, torch.optim.AdamW on the others.

    One optimizer for the loop, the scheduler and the checkpoint: its `param_groups` are the very
    dicts the two torch optimizers hold and its `state` is theirs (keyed by parameter, so they
    never collide); after `load_state_dict` replaces both, the two are rebuilt over the new ones.
    """

    def __init__(
        self,
        params: Iterable[dict],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.0,
        momentum: float = 0.95,
    ):
        self._settings = dict(lr=lr, betas=betas, weight_decay=weight_decay, momentum=momentum)
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, use_muon=False))
        self._link()

    def _link(self) -> None:
        s = self._settings
        muon = [g for g in self.param_groups if g["use_muon"]]
        rest = [g for g in self.param_groups if not g["use_muon"]]
        # the torch optimizers append these same dicts (filling in their own defaults)
        self._parts = []
        if muon:
            self._parts.append(
                muon_class(muon[0]["params"][0].device)(
                    muon,
                    lr=s["lr"],
                    weight_decay=s["weight_decay"],
                    momentum=s["momentum"],
                    adjust_lr_fn="match_rms_adamw",
                )
            )
        if rest:
            self._parts.append(adamw(rest, s["lr"], s["betas"], s["weight_decay"]))
        for part in self._parts:
            part.state = self.state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if "_settings" in self.__dict__:  # load_state_dict: new group dicts and state
            self._link()

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = closure_loss(closure)
        for part in self._parts:
            part.step()
        return loss


def is_hidden_matrix(module: nn.Module, vocab_sizes: set[int]) -> bool:
    """A Linear whose weight is a genuine 2-D hidden matrix: not a vocabulary projection
    (either side a vocab size) and not a vector in disguise (a side of 1)."""
    if not isinstance(module, nn.Linear):
        return False
    shape = tuple(module.weight.shape)
    return min(shape) > 1 and not (set(shape) & vocab_sizes)


def param_groups(model: nn.Module, weight_decay: float, vocab_sizes: set[int] | None) -> list[dict]:
    """Trainable parameters in groups: Muon matrices (when vocab_sizes is given), then AdamW
    with decay (matrices) and without (norms, biases, vectors). Frozen tensors are left out."""
    muon: list[nn.Parameter] = []
    if vocab_sizes is not None:
        muon = [
            m.weight for m in model.modules() if is_hidden_matrix(m, vocab_sizes) and m.weight.requires_grad
        ]
    taken = {id(p) for p in muon}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in taken]
    groups = [
        {"params": [p for p in rest if p.ndim >= 2], "weight_decay": weight_decay, "use_muon": False},
        {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0, "use_muon": False},
    ]
    if muon:
        groups.insert(0, {"params": muon, "weight_decay": weight_decay, "use_muon": True})
    return [g for g in groups if g["params"]]


def vocab_sizes(vocab_size: int, d2t: torch.Tensor | None) -> set[int]:
    """The vocabulary sizes `is_hidden_matrix` keeps off Muon: the verifier's and the draft
    vocabulary's (the length of d2t; the verifier's when there is none)."""
    return {vocab_size, vocab_size if d2t is None else d2t.numel()}


def build_optimizer(model: nn.Module, train: TrainSection, vocab_sizes: set[int]) -> torch.optim.Optimizer:
    """`train.optimizer`: adamw, or muon (Muon on hidden matrices, AdamW on the rest)."""
    if train.optimizer == "muon":
        groups = param_groups(model, train.weight_decay, vocab_sizes)
        return MuonAdamW(groups, lr=train.lr, betas=train.betas, weight_decay=train.weight_decay)
    groups = [
        {k: v for k, v in g.items() if k != "use_muon"} for g in param_groups(model, train.weight_decay, None)
    ]
    return adamw(groups, train.lr, train.betas, train.weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, train: TrainSection) -> lr_scheduler.LRScheduler:
    """Warmup + `train.schedule` (see `lr_at`), stepped once per optimizer step.

    Every group starts at `train.lr`, so CosineAnnealingLR's absolute floor is the same for all.
    """
    warmup, decay_steps = train.warmup_steps, max(1, train.max_steps - 1 - train.warmup_steps)
    if train.schedule == "cosine":
        decay: lr_scheduler.LRScheduler = lr_scheduler.CosineAnnealingLR(
            optimizer, decay_steps, train.lr * train.min_lr_ratio
        )
    elif train.schedule == "linear":
        decay = lr_scheduler.LinearLR(optimizer, 1.0, train.min_lr_ratio, decay_steps)
    else:
        decay = lr_scheduler.ConstantLR(optimizer, 1.0, 0)
    if warmup == 0:
        return decay
    # built after `decay`, so the optimizer starts at warmup's first LR (SequentialLR resets to it)
    ramp = lr_scheduler.LinearLR(optimizer, 1.0 / warmup, 1.0, warmup - 1)
    return lr_scheduler.SequentialLR(optimizer, [ramp, decay], [warmup])


def scheduler_at(
    optimizer: torch.optim.Optimizer, train: TrainSection, step: int
) -> lr_scheduler.LRScheduler:
    """`train`'s schedule after `step` optimizer steps, on an optimizer whose state a checkpoint
    restored: what a resumed run continues with.

    The schedule is rebuilt from the recipe and replayed, not loaded from the checkpoint: a
    scheduler's state holds its length (CosineAnnealingLR's T_max), so a run resumed with more
    steps would run the old, finished curve on into its next period (the LR climbing back up).
    Replayed, step s gets `lr_at(s, ..., train.max_steps)`: the schedule of the new length, as if
    the run had been planned that long from the start (docs/training.md). With the same settings
    the replay repeats the uninterrupted run's arithmetic: the same LR to the bit. Every group
    restarts at `train.lr` (build_scheduler), whatever LR the restored optimizer state carries.
    """
    for group in optimizer.param_groups:
        group.pop("initial_lr", None)
        group["lr"] = train.lr
    scheduler = build_scheduler(optimizer, train)
    with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": on purpose
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(step):
            scheduler.step()
    return scheduler
