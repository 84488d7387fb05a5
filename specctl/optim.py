"""Optimizers and learning-rate schedules for drafter training.

AdamW is the default. Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers")
replaces the AdamW update of 2-D hidden weight matrices with their orthogonalised momentum
(Newton-Schulz iteration), which trains transformer blocks faster per step; embeddings,
output heads, norms and vectors stay on AdamW. Following Moonshot ("Muon is Scalable for
LLM Training", 2025) the orthogonal update is scaled by 0.2 * sqrt(max(rows, cols)) so its
RMS matches AdamW's and the same `train.lr` and `train.weight_decay` serve both.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from specctl.recipe import TrainSection


def lr_at(
    step: int, peak: float, warmup_steps: int, max_steps: int, schedule: str, min_lr_ratio: float
) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup to `peak`, then decay.

    Warmup reaches the peak at step `warmup_steps - 1`; cosine and linear then fall to
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


def orthogonalize(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Approximate U V^T of G = U S V^T with a quintic Newton-Schulz iteration.

    The coefficients (3.4445, -4.7750, 2.0315) trade exactness for speed: singular values
    land in roughly [0.7, 1.2] instead of exactly 1, which works as well for Muon. Runs in
    bfloat16 on CUDA (tensor cores) and float32 elsewhere.
    """
    if G.ndim != 2:
        raise ValueError(f"orthogonalize expects a matrix, got shape {tuple(G.shape)}")
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.to(torch.bfloat16 if G.is_cuda else torch.float32)
    transposed = X.shape[0] > X.shape[1]
    if transposed:  # iterate on the wide side: X @ X.T is the smaller Gram matrix
        X = X.T
    X = X / (X.norm() + 1e-7)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return (X.T if transposed else X).to(G.dtype)


class Muon(torch.optim.Optimizer):
    """Muon on param groups with `use_muon=True`, AdamW on the others: one optimizer, one state dict.

    Muon: m = lerp(m, g, 1 - momentum); update = lerp(g, m, momentum) (Nesterov);
    p -= lr * 0.2 * sqrt(max(rows, cols)) * orthogonalize(update). Decoupled weight decay on both.
    Sharded (FSDP2 DTensor) matrices are gathered for the orthogonalisation, which needs the
    whole matrix; every rank computes the same result and keeps its own shard of it.
    """

    def __init__(
        self,
        params: Iterable[dict],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        ns_steps: int = 5,
    ):
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            momentum=momentum,
            ns_steps=ns_steps,
            use_muon=False,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                p.mul_(1.0 - lr * wd)
                if group["use_muon"]:
                    self._muon_update(p, state, group)
                else:
                    self._adamw_update(p, state, group)
        return loss

    @staticmethod
    def _muon_update(p: torch.Tensor, state: dict, group: dict) -> None:
        g = p.grad
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(g)
        buf = state["momentum_buffer"]
        buf.lerp_(g, 1.0 - group["momentum"])
        update = g.lerp(buf, group["momentum"])
        sharded = hasattr(update, "full_tensor")  # DTensor under FSDP2
        full = update.full_tensor() if sharded else update
        rows, cols = full.shape[0], full.flatten(1).shape[1]
        ortho = orthogonalize(full.flatten(1), group["ns_steps"]).view_as(full)
        if sharded:
            from torch.distributed.tensor import distribute_tensor

            ortho = distribute_tensor(ortho, update.device_mesh, update.placements, src_data_rank=None)
        p.add_(ortho, alpha=-group["lr"] * 0.2 * math.sqrt(max(rows, cols)))

    @staticmethod
    def _adamw_update(p: torch.Tensor, state: dict, group: dict) -> None:
        g = p.grad
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        beta1, beta2 = group["betas"]
        state["step"] += 1
        t = float(state["step"])
        state["exp_avg"].lerp_(g, 1.0 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = (state["exp_avg_sq"] / (1.0 - beta2**t)).sqrt_().add_(group["eps"])
        p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1.0 - beta1**t))


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


def build_optimizer(model: nn.Module, train: TrainSection, vocab_sizes: set[int]) -> torch.optim.Optimizer:
    """`train.optimizer`: adamw, or muon (Muon on hidden matrices, AdamW on the rest)."""
    if train.optimizer == "muon":
        groups = param_groups(model, train.weight_decay, vocab_sizes)
        return Muon(groups, lr=train.lr, betas=train.betas, weight_decay=train.weight_decay)
    groups = [
        {k: v for k, v in g.items() if k != "use_muon"} for g in param_groups(model, train.weight_decay, None)
    ]
    return torch.optim.AdamW(groups, lr=train.lr, betas=train.betas, weight_decay=train.weight_decay)


def build_scheduler(
    optimizer: torch.optim.Optimizer, train: TrainSection
) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup + `train.schedule`, as a multiplier of each group's base LR (step() once per optimizer step)."""

    def factor(step: int) -> float:
        return lr_at(step, 1.0, train.warmup_steps, train.max_steps, train.schedule, train.min_lr_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
