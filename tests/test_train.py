"""Training loop: schedules, Muon, batching, checkpoints, resume, validation, fail-fast errors.

Pure pieces are checked against brute-force references; the loop runs end to end on a tiny
random verifier (features computed in code) with a small test-double drafter and with the real
drafters.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import json
import math
import os
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from reliability_matrix import fault
from torch import nn

from specctl import checkpoint as ckpt
from specctl.batching import length_buckets
from specctl.collect import collect
from specctl.data import load_token_freq
from specctl.distributed import DistContext, rank_share
from specctl.drafters import DRAFTERS
from specctl.drafters.api import DrafterSpec, VerifierWeights
from specctl.drafters.targets import build_draft_vocab, draft_loss, verifier_targets
from specctl.errors import CheckpointError, DataError, FeatureStoreError, SpecctlError
from specctl.features import (
    Layout,
    StorePlan,
    TargetHead,
    encode_features,
    finalize_store,
    init_store,
    open_features,
    write_shard,
)
from specctl.optim import (
    Float32Muon,
    MuonAdamW,
    adamw,
    build_optimizer,
    build_scheduler,
    is_hidden_matrix,
    lr_at,
    muon_class,
    muon_lr_ratio,
    newton_schulz_fp32,
    param_groups,
    scheduler_at,
)
from specctl.recipe import Recipe, TrainSection, config_diff, load_recipe, recipe_from_dict
from specctl.train import loop as train_mod
from specctl.train.loader import StepSampler, collate, data_workers, micro_batch_at
from specctl.train.loop import Source, run_training, split_indices, tau_hat
from specctl.verifier import capture_hidden_states, spec_from_config

CPU = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), owns_group=False)


# ---------------------------------------------------------------- schedules


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_lr_schedule_warmup_then_decay(schedule):
    peak, warmup, max_steps, floor = 1e-3, 4, 20, 0.1
    lrs = [lr_at(s, peak, warmup, max_steps, schedule, floor) for s in range(max_steps)]
    assert lrs[:warmup] == pytest.approx([peak * (s + 1) / warmup for s in range(warmup)])
    assert lrs[warmup] == pytest.approx(peak)
    if schedule == "constant":
        assert lrs[warmup:] == pytest.approx([peak] * (max_steps - warmup))
        return
    assert lrs[-1] == pytest.approx(peak * floor)
    decay = lrs[warmup:]
    assert all(a >= b for a, b in zip(decay, decay[1:], strict=False))
    progress = [(s - warmup) / (max_steps - 1 - warmup) for s in range(warmup, max_steps)]
    shape = [0.5 * (1 + math.cos(math.pi * p)) if schedule == "cosine" else 1 - p for p in progress]
    assert decay == pytest.approx([peak * (floor + (1 - floor) * x) for x in shape])


def test_lr_schedule_no_warmup_and_one_step():
    assert lr_at(0, 2.0, 0, 10, "cosine", 0.0) == pytest.approx(2.0)
    assert lr_at(0, 2.0, 0, 1, "linear", 0.5) == pytest.approx(2.0)


def _scheduled_lrs(cfg: TrainSection) -> list[float]:
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=cfg.lr)
    sched = build_scheduler(opt, cfg)
    lrs = []
    for _ in range(cfg.max_steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
@pytest.mark.parametrize(("warmup", "max_steps"), [(0, 30), (1, 2), (4, 20), (6, 3), (50, 1000)])
def test_torch_scheduler_runs_the_closed_form(schedule, warmup, max_steps):
    """build_scheduler (torch's LinearLR / CosineAnnealingLR / SequentialLR) against lr_at."""
    cfg = TrainSection(lr=2e-3, warmup_steps=warmup, max_steps=max_steps, schedule=schedule, min_lr_ratio=0.1)
    expected = [lr_at(s, cfg.lr, warmup, max_steps, schedule, 0.1) for s in range(max_steps)]
    assert _scheduled_lrs(cfg) == pytest.approx(expected, rel=1e-9)


def test_scheduler_at_replays_the_schedule_of_the_recipe_it_resumes_with():
    """A resumed run's schedule (`scheduler_at`): with the same settings, the uninterrupted run's LRs
    to the bit, whatever LR the restored optimizer carries; with a new max_steps, the new length's
    closed form from the resumed step on (never the old curve run on into its next period)."""
    cfg = TrainSection(lr=1e-3, warmup_steps=5, max_steps=40)
    straight = _scheduled_lrs(cfg)

    def resumed(train: TrainSection, at: int) -> list[float]:
        opt = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=cfg.lr)
        opt.param_groups[0]["lr"] = 0.123  # what a restored optimizer state carries: ignored
        opt.param_groups[0]["initial_lr"] = 0.5
        sched = scheduler_at(opt, train, at)
        lrs = []
        for _ in range(at, train.max_steps):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return lrs

    assert resumed(cfg, 17) == straight[17:]  # bitwise: the same arithmetic, replayed
    longer = cfg.model_copy(update={"max_steps": 60})
    expected = [lr_at(s, cfg.lr, 5, 60, "cosine", cfg.min_lr_ratio) for s in range(17, 60)]
    assert resumed(longer, 17) == pytest.approx(expected, rel=1e-9)
    assert all(a >= b for a, b in itertools.pairwise(resumed(longer, 17)))  # no climb back up


# ---------------------------------------------------------------- Muon


def _twins():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 3))
    b = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 3))
    b.load_state_dict(a.state_dict())
    return a, b


def _train(model, opts, steps=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        for o in opts:
            o.zero_grad()
        model(x).pow(2).mean().backward()
        for o in opts:
            o.step()


def test_adamw_is_fused_where_torch_has_the_kernel_and_moves_as_the_default_does():
    """The fused kernel is the same AdamW: after a few steps the weights match torch's default
    implementation to rounding; it is chosen on CPU, and not on a device without the kernel."""
    a, b = _twins()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    ours = adamw([{"params": list(a.parameters())}], **kw)
    assert ours.param_groups[0]["fused"] is True
    _train(a, [ours], steps=6)
    _train(b, [torch.optim.AdamW(b.parameters(), **kw)], steps=6)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    on_meta = torch.nn.Parameter(torch.empty(3, 3, device="meta"))
    assert not adamw([{"params": [on_meta]}], **kw).param_groups[0]["fused"]


@pytest.fixture
def bf16_cpu(monkeypatch):
    """Pretend the CPU computes bf16 natively (True) or emulates it (False)."""

    def pretend(native: bool) -> None:
        monkeypatch.setattr("specctl.devices.cpu_has_native_bf16", lambda: native)

    return pretend


def test_muon_adamw_is_torch_muon_plus_torch_adamw(bf16_cpu):
    """The router does no math of its own: it moves parameters exactly as torch.optim.Muon (on
    the hidden matrix) and torch.optim.AdamW (on the rest) do side by side, where bf16 is native."""
    bf16_cpu(True)
    a, b = _twins()
    kw = dict(lr=1e-2, weight_decay=0.1)
    ours = MuonAdamW(
        [
            {"params": [a[0].weight], "use_muon": True},
            {"params": [a[0].bias, a[1].weight, a[1].bias], "use_muon": False},
        ],
        betas=(0.9, 0.95),
        **kw,
    )
    ref = [
        torch.optim.Muon([b[0].weight], adjust_lr_fn="match_rms_adamw", **kw),
        torch.optim.AdamW([b[0].bias, b[1].weight, b[1].bias], betas=(0.9, 0.95), fused=True, **kw),
    ]
    _train(a, [ours])
    _train(b, ref)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    # one state for the checkpoint: Muon's momentum and AdamW's moments, keyed by parameter
    assert set(ours.state[a[0].weight]) == {"momentum_buffer"}
    assert set(ours.state[a[1].weight]) == {"step", "exp_avg", "exp_avg_sq"}


def _newton_schulz_float64(G, steps=5, coefficients=(3.4445, -4.7750, 2.0315)):
    """The quintic iteration written out plainly in float64: X <- aX + (bA + cA^2)X, A = XX^T."""
    a, b, c = coefficients
    X = G.double().T if G.shape[0] > G.shape[1] else G.double()
    X = X / X.norm()
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if G.shape[0] > G.shape[1] else X


@pytest.mark.parametrize("shape", [(16, 8), (8, 16), (24, 24)])
def test_float32_newton_schulz_is_the_iteration_and_close_to_torchs_bf16(shape):
    torch.manual_seed(0)
    G = torch.randn(*shape)
    ours = newton_schulz_fp32(G, (3.4445, -4.7750, 2.0315), 5, 1e-7)
    assert ours.dtype == torch.float32 and ours.shape == G.shape
    torch.testing.assert_close(ours.double(), _newton_schulz_float64(G), rtol=1e-5, atol=1e-5)
    from torch.optim._muon import _zeropower_via_newtonschulz

    theirs = _zeropower_via_newtonschulz(G, (3.4445, -4.7750, 2.0315), 5, 1e-7).float()  # bfloat16 inside
    assert (theirs - ours).norm() / ours.norm() < 0.03  # bf16 rounding, not another iteration


def test_muon_on_a_cpu_that_emulates_bf16_is_torchs_loop_in_float32(bf16_cpu, monkeypatch):
    """Where bf16 is emulated the router picks Float32Muon: torch's Muon step for step, with the
    Newton-Schulz iteration in float32 (torch's own loop with a float32 iteration swapped in)."""
    from torch.optim import _muon

    bf16_cpu(False)
    assert muon_class(torch.device("cpu")) is Float32Muon
    assert muon_class(torch.device("cuda")) is torch.optim.Muon  # CUDA: bf16 is native there
    a, b = _twins()
    kw = dict(lr=1e-2, weight_decay=0.1)
    ours = MuonAdamW([{"params": [a[0].weight], "use_muon": True}], **kw)
    assert type(ours._parts[0]) is Float32Muon

    def float32_iteration(grad, ns_coefficients, ns_steps, eps):
        return newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps).to(grad.dtype)

    monkeypatch.setattr(_muon, "_zeropower_via_newtonschulz", float32_iteration)
    ref = torch.optim.Muon([b[0].weight], adjust_lr_fn="match_rms_adamw", **kw)
    before = a[0].weight.detach().clone()
    _train(a, [ours])
    _train(b, [ref])
    assert not torch.equal(a[0].weight, before)  # it moved
    assert torch.equal(a[0].weight, b[0].weight)
    assert set(ours.state[a[0].weight]) == {"momentum_buffer"}  # the same state: checkpoints move
    torch.testing.assert_close(
        ours.state[a[0].weight]["momentum_buffer"], ref.state[b[0].weight]["momentum_buffer"]
    )


def test_muon_lr_ratio_is_torchs():
    from torch.optim._muon import _adjust_lr

    for fn in (None, "original", "match_rms_adamw"):
        for shape in ((16, 8), (8, 16)):
            assert muon_lr_ratio(fn, torch.Size(shape)) == pytest.approx(
                _adjust_lr(1.0, fn, torch.Size(shape))
            )


def test_muon_adamw_state_dict_round_trip_continues_identically():
    a, b = _twins()

    def make(model):
        groups = param_groups(model, 0.0, {3})
        return MuonAdamW(groups, lr=1e-2)

    opt_a = make(a)
    _train(a, [opt_a], steps=2)
    b.load_state_dict(a.state_dict())
    opt_b = make(b)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # as read back from a checkpoint
    _train(a, [opt_a], steps=3, seed=7)
    _train(b, [opt_b], steps=3, seed=7)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    # the scheduler sets LRs through the shared group dicts
    opt_b.param_groups[0]["lr"] = 0.0
    assert opt_b._parts[0].param_groups[0]["lr"] == 0.0


class _Toy(nn.Module):
    def __init__(self, V=50, H=16):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.layers = nn.ModuleList([nn.Linear(H, H), nn.Linear(H, 2 * H)])
        self.norm = nn.LayerNorm(H)
        self.confidence = nn.Linear(H, 1)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.frozen = nn.Linear(H, H)
        self.frozen.requires_grad_(False)


def test_muon_takes_hidden_matrices_only():
    toy = _Toy()
    assert is_hidden_matrix(toy.fc, {50}) and not is_hidden_matrix(toy.lm_head, {50})
    assert not is_hidden_matrix(toy.confidence, {50}) and not is_hidden_matrix(toy.embed, {50})
    groups = param_groups(toy, 0.1, {50})
    muon = {id(p) for g in groups if g["use_muon"] for p in g["params"]}
    expected = {id(toy.fc.weight), id(toy.layers[0].weight), id(toy.layers[1].weight)}
    assert muon == expected
    everything = [p for g in groups for p in g["params"]]
    assert len(everything) == len({id(p) for p in everything})  # no parameter twice
    assert {id(p) for p in everything} == {id(p) for p in toy.parameters() if p.requires_grad}
    no_decay = [g for g in groups if g["weight_decay"] == 0.0]
    assert all(p.ndim < 2 for g in no_decay for p in g["params"])


def test_build_optimizer_kinds():
    toy = _Toy()
    adamw = build_optimizer(toy, TrainSection(optimizer="adamw", weight_decay=0.1), {50})
    assert isinstance(adamw, torch.optim.AdamW)
    muon = build_optimizer(toy, TrainSection(optimizer="muon"), {50})
    assert isinstance(muon, MuonAdamW) and muon.param_groups[0]["use_muon"]


# ---------------------------------------------------------------- batching


def test_split_is_seeded_disjoint_and_complete():
    train, val = split_indices(100, 0.1, seed=3)
    assert len(val) == 10 and sorted(train + val) == list(range(100))
    assert (train, val) == split_indices(100, 0.1, seed=3)
    assert val != split_indices(100, 0.1, seed=4)[1]
    assert split_indices(5, 0.01, 0)[1] != [] and split_indices(5, 0.0, 0)[1] == []
    assert len(split_indices(2, 0.9, 0)[0]) == 1  # never leaves nothing to train on


def test_length_buckets_respect_budget_and_are_maximal():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 60, (200,), generator=g).tolist()
    lengths[7] = 500  # longer than the budget: alone, cropped later
    indices = list(range(0, 200, 2)) + [7]
    budget = 128
    buckets = length_buckets(lengths, budget, indices)
    assert sorted(i for b in buckets for i in b) == sorted(indices)
    flat = [i for b in buckets for i in b]
    assert [lengths[i] for i in flat] == sorted(lengths[i] for i in indices)  # sorted by length
    for b, nxt in zip(buckets, buckets[1:] + [None], strict=True):
        padded = len(b) * min(max(lengths[i] for i in b), budget)
        assert padded <= budget
        if nxt is not None:  # greedy: the next sample would not have fit
            assert (len(b) + 1) * min(lengths[nxt[0]], budget) > budget
    assert [7] in buckets


def test_micro_batch_stream_shuffles_each_epoch():
    buckets = [[i] for i in range(10)]
    epoch0 = [micro_batch_at(buckets, c, seed=0)[0] for c in range(10)]
    epoch1 = [micro_batch_at(buckets, c, seed=0)[0] for c in range(10, 20)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1
    assert epoch0 == [micro_batch_at(buckets, c, seed=0)[0] for c in range(10)]
    assert epoch0 != [micro_batch_at(buckets, c, seed=1)[0] for c in range(10)]


def test_rank_share_partitions_the_step():
    chunk = list(range(6))
    shares = [rank_share(chunk, 3, r) for r in range(2)]
    assert shares == [[0, 1, 2], [3, 4, 5]]


def test_collate_pads_and_crops():
    a = {
        "input_ids": torch.arange(1, 4),
        "loss_mask": torch.tensor([0, 1, 1]),
        "aux_hidden_states": torch.ones(3, 2, 4, dtype=torch.bfloat16),
        "last_hidden_state": torch.ones(3, 4),
    }
    b = {
        "input_ids": torch.arange(1, 7),
        "loss_mask": torch.ones(6),
        "aux_hidden_states": torch.full((6, 2, 4), 2.0, dtype=torch.bfloat16),
        "last_hidden_state": torch.full((6, 4), 2.0),
    }
    batch = collate([a, b], max_tokens=5)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0, 0], [1, 2, 3, 4, 5]]
    assert batch["attention_mask"].tolist() == [[True] * 3 + [False] * 2, [True] * 5]
    assert batch["loss_mask"].tolist() == [[False, True, True, False, False], [True] * 5]
    assert (
        batch["aux_hidden_states"].shape == (2, 5, 2, 4)
        and batch["aux_hidden_states"].dtype == torch.bfloat16
    )
    assert batch["aux_hidden_states"][0, 3:].abs().sum() == 0 and batch["last_hidden_state"][1].eq(2).all()


def test_tau_hat_matches_brute_force():
    acc = [0.9, 0.5, 0.25]
    brute = 1 + sum(math.prod(acc[: k + 1]) for k in range(len(acc)))
    assert tau_hat(acc) == pytest.approx(brute)
    assert tau_hat([]) == 1.0 and tau_hat([1.0] * 4) == 5.0


# ---------------------------------------------------------------- checkpoint files


def _tiny_state(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model.register_buffer("d2t", torch.arange(3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def test_checkpoint_round_trip_and_latest(tmp_path):
    model, opt = _tiny_state(0)
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        path = ckpt.save_checkpoint(
            root,
            step,
            model,
            opt,
            {"step": step, "cursor": 7 * step},
            "name: x\n",
            {"algo": "toy"},
            CPU,
            keep=2,
        )
    assert path == root / "step-3" and ckpt.latest_checkpoint(root) == path
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-2", "step-3"]
    assert ckpt.read_meta(path) == {"algo": "toy", "step": 3}
    torch.manual_seed(123)
    expected_rng = torch.rand(3)
    torch.manual_seed(123)
    ckpt.save_checkpoint(root, 4, model, opt, {"step": 4, "cursor": 1}, "", {}, CPU, keep=2)

    fresh, fresh_opt = _tiny_state(1)
    state = ckpt.load_checkpoint(root / "step-4", fresh, fresh_opt, CPU)
    assert state["cursor"] == 1
    assert torch.equal(torch.rand(3), expected_rng)  # RNG restored to the moment of saving
    for (k, v), (k2, v2) in zip(model.state_dict().items(), fresh.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(v, v2)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], fresh_opt.state_dict()["state"][0]["exp_avg"])
    assert ckpt.load_drafter_state(root / "step-4").keys() == model.state_dict().keys()


@fault(
    stage="train",
    fault="crash mid-checkpoint: a temporary dir, a step dir missing files, `latest` pointing at it",
    result="resume uses the previous complete checkpoint; leftovers are pruned",
)
def test_half_written_checkpoint_is_never_picked(tmp_path):
    model, opt = _tiny_state(0)
    root = tmp_path / "checkpoints"
    good = ckpt.save_checkpoint(root, 5, model, opt, {"step": 5, "cursor": 0}, "", {}, CPU, keep=3)
    # a crash mid-write: a temp dir and a step dir with a file missing, and `latest` pointing at it
    (root / ".step-10.tmp-1073741823").mkdir()
    broken = root / "step-10"
    broken.mkdir()
    (broken / ckpt.DRAFTER_FILE).write_bytes(b"")
    (root / "latest").write_text("step-10\n")
    assert ckpt.latest_checkpoint(root) == good
    assert ckpt.find_checkpoint(tmp_path) == good  # from the parent (drafters/<algo>) dir too
    ckpt.prune(root, keep=3)
    assert not (root / ".step-10.tmp-1073741823").exists()


# ---------------------------------------------------------------- the loop: shared helpers
# (tests/test_distributed.py imports these: it runs the same runs on 2 ranks)

VOCAB, HIDDEN, LAYERS, AUX = 256, 64, 4, (1, 2, 3)


@functools.cache
def tiny_world(num_samples: int = 24, seed: int = 0):
    """A random 4-layer Llama verifier, what drafters see of it, and feature-store samples
    (random sequences over 32 token ids, last two thirds loss-masked, hidden states stored in bfloat16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    spec = spec_from_config(config, "tiny-llama", AUX, VOCAB - 1)
    weights = VerifierWeights(
        embed_tokens=model.model.embed_tokens.weight.detach(),
        lm_head=model.lm_head.weight.detach(),
        norm=model.model.norm.weight.detach(),
    )
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(num_samples):
        T = int(torch.randint(10, 40, (1,), generator=g))
        ids = torch.randint(3, 35, (1, T), generator=g)  # few distinct tokens: learnable from 18 samples
        aux, last = capture_hidden_states(model, ids, None, AUX)
        samples.append(
            {
                "input_ids": ids[0],
                "loss_mask": torch.arange(T) >= T // 3,
                "aux_hidden_states": aux[0].bfloat16(),
                "last_hidden_state": last[0].bfloat16(),
            }
        )
    return spec, weights, samples


def tiny_source(samples=None) -> Source:
    spec, weights, stored = tiny_world()
    samples = stored if samples is None else samples
    return Source([len(s["input_ids"]) for s in samples], samples.__getitem__, lambda b: b, spec, weights)


class NanGradient(torch.autograd.Function):
    """Identity forward, NaN backward: an overflow in a backward under a finite loss."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class ToyDrafter(nn.Module):
    """Test double honouring the drafter contract: two heads read the aux features at t and
    predict the verifier's tokens t+1 and t+2 (K=2). In training it keeps a random 70% of rows,
    so results depend on the RNG the loop seeds. Class attributes script failures."""

    nan_at: int | None = None  # return a NaN loss on this training forward
    nan_grad_at: frozenset[int] = frozenset()  # a finite loss whose gradients are NaN on these forwards
    built: list = []  # d2t of every drafter built, newest last

    def __init__(self, spec, weights, d2t, loss):
        super().__init__()
        H = spec.hidden_size
        self.fc = nn.Linear(len(spec.aux_layer_ids) * H, H)
        self.heads = nn.ModuleList(nn.Linear(H, H) for _ in range(2))
        self.out = nn.Linear(H, spec.vocab_size if d2t is None else d2t.numel(), bias=False)
        self.register_buffer("lm_head", weights.lm_head.detach(), persistent=False)
        self.register_buffer("norm_weight", weights.norm.detach(), persistent=False)
        t2d = None
        if d2t is not None:
            t2d = torch.zeros(spec.vocab_size, dtype=torch.bool)
            t2d[torch.arange(d2t.numel()) + d2t] = True
        self.register_buffer("t2d", t2d)
        self.eps, self.kind, self.calls = spec.rms_norm_eps, loss, 0
        ToyDrafter.built.append(d2t)

    def forward(self, batch):
        self.calls += self.training
        h = torch.tanh(self.fc(batch["aux_hidden_states"].flatten(2)))  # [B, T, H]
        if self.training and self.calls in ToyDrafter.nan_grad_at:
            h = NanGradient.apply(h)
        counted = batch["loss_mask"] & batch["attention_mask"]  # [B, T]
        T = counted.shape[1]
        losses, correct, count = [], [], []
        for k, head in enumerate(self.heads):
            rows = torch.zeros_like(counted)
            rows[:, : T - 1 - k] = counted[:, 1 + k :]  # position t predicts token t+1+k
            if self.training:
                rows &= torch.rand(rows.shape, device=rows.device) < 0.7
            b, t = rows.nonzero(as_tuple=True)
            logits = self.out(head(h[b, t]))
            target = verifier_targets(
                batch["last_hidden_state"][b, t + k], self.norm_weight, self.lm_head, self.eps, self.t2d
            )
            loss_rows, ok, usable = draft_loss(logits, target, self.t2d, self.kind)
            losses.append((loss_rows * usable).sum() / usable.sum().clamp(min=1))
            correct.append(ok.sum().float())
            count.append(torch.tensor(float(b.numel()), device=h.device))
        loss = (losses[0] + losses[1]) / 2
        if self.training and self.calls == ToyDrafter.nan_at:
            loss = loss * float("nan")
        return loss, {"loss": loss.detach(), "correct": torch.stack(correct), "count": torch.stack(count)}


def use_toy_drafter() -> dict:
    """DRAFTERS entries that build the toy under the name `dflash` (its recipe section is ignored)."""
    real = DRAFTERS["dflash"]
    toy = dataclasses.replace(
        real, build=lambda config, spec, weights, d2t, loss: ToyDrafter(spec, weights, d2t, loss)
    )
    ToyDrafter.nan_at, ToyDrafter.nan_grad_at = None, frozenset()
    return {"dflash": toy}


TINY_DRAFTERS = {name: spec.tiny for name, spec in DRAFTERS.items()}  # each algorithm's smallest section


def tiny_recipe(
    output_dir, algo: str = "dflash", name: str = "t", extra: dict | None = None, **train
) -> Recipe:
    """A recipe for the tiny world; `extra` merges into the other sections (e.g. {"drafter": {...}})."""
    extra = extra or {}
    tree = {
        "name": name,
        "output_dir": str(output_dir),
        "verifier": {"device": "cpu", **extra.get("verifier", {})},
        "data": extra.get("data", {}),
        "features": {"aux_layer_ids": list(AUX), **extra.get("features", {})},
        "drafter": {"algo": algo, algo: TINY_DRAFTERS[algo], **extra.get("drafter", {})},
        "train": {
            "max_steps": 6,
            "lr": 3e-3,
            "warmup_steps": 2,
            "batch_tokens": 160,
            "val_fraction": 0.25,
            "eval_every": 3,
            "save_every": 3,
            "log_every": 1,
            "keep_checkpoints": 2,
            # float32: the tiny world's figures must not depend on whether this CPU has bf16
            # (`auto`); the bf16 path has tests of its own
            "precision": "float32",
            **train,
        },
    }
    return recipe_from_dict(tree)


def read_metrics(recipe: Recipe) -> list[dict]:
    path = recipe.run_dir / "drafters" / recipe.drafter.algo / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def train_lines(records: list[dict]) -> list[dict]:
    return [r for r in records if "loss" in r]


def val_lines(records: list[dict]) -> list[dict]:
    return [r for r in records if "val_loss" in r]


@pytest.fixture
def offline(monkeypatch):
    """Run the loop on the in-memory feature samples (the store and verifier are tested apart)."""
    source = tiny_source()
    monkeypatch.setattr(train_mod, "open_source", lambda recipe, ctx, progress: source)
    return source


@pytest.fixture
def toy(monkeypatch):
    for name, spec in use_toy_drafter().items():
        monkeypatch.setitem(DRAFTERS, name, spec)
    yield ToyDrafter
    ToyDrafter.nan_at, ToyDrafter.nan_grad_at = None, frozenset()


# ---------------------------------------------------------------- the loop: behaviour


def test_offline_run_writes_metrics_checkpoints_and_summary(tmp_path, offline, toy):
    recipe = tiny_recipe(tmp_path)
    summary = run_training(recipe, progress=True)
    records = read_metrics(recipe)
    train = train_lines(records)
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 and "grad_norm" in r for r in train)
    assert train[0]["lr"] == pytest.approx(3e-3 / 2) and train[1]["lr"] == pytest.approx(3e-3)
    val = val_lines(records)
    assert [r["step"] for r in val] == [3, 6]
    for r in val:
        assert len(r["val_acc_per_position"]) == 2 and r["tau_hat"] == pytest.approx(
            tau_hat(r["val_acc_per_position"])
        )
    out = tmp_path / "t" / "drafters" / "dflash"
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-3", "step-6"]
    assert (root / "latest").read_text().strip() == "step-6"
    meta = ckpt.read_meta(root / "step-6")
    assert meta["algo"] == "dflash" and meta["verifier"]["hidden_size"] == HIDDEN and meta["step"] == 6
    assert load_recipe(root / "step-6" / "recipe.yaml") == recipe
    assert summary.steps == 6 and summary.algo == "dflash" and summary.checkpoint == root / "step-6"
    assert summary.loss == train[-1]["loss"] and summary.tau_hat == val[-1]["tau_hat"]
    assert summary.val_acc_per_position == val[-1]["val_acc_per_position"] and summary.output_dir == out


def test_a_per_algo_step_budget_is_what_trains_and_what_the_checkpoint_records(tmp_path, offline, toy):
    per_algo = {"dflash": {"max_steps": 4}, "eagle3": {"max_steps": 9}}
    recipe = tiny_recipe(tmp_path, max_steps=2, eval_every=2, save_every=2, per_algo=per_algo)
    summary = run_training(recipe, progress=False)
    assert summary.steps == 4 and [r["step"] for r in train_lines(read_metrics(recipe))] == [1, 2, 3, 4]
    saved = load_recipe(summary.checkpoint / "recipe.yaml")
    assert saved.train.max_steps == 4 and saved == recipe.for_training()


def test_real_dflash_learns(tmp_path, offline):
    # ce: the random verifier's distribution is near uniform, so KL has little room; its argmax is learnable
    recipe = tiny_recipe(
        tmp_path, loss="ce", max_steps=16, eval_every=16, save_every=16, lr=1e-2, batch_tokens=256
    )
    summary = run_training(recipe, progress=False)
    losses = [r["loss"] for r in train_lines(read_metrics(recipe))]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.25  # nats
    assert summary.tau_hat > 1.0 and math.isfinite(summary.val_loss)


@pytest.mark.parametrize("algo", sorted(TINY_DRAFTERS))
def test_every_registered_drafter_trains_through_the_same_loop(tmp_path, offline, algo):
    assert algo in DRAFTERS
    recipe = tiny_recipe(tmp_path, algo=algo, max_steps=2, eval_every=2, save_every=2)
    summary = run_training(recipe, progress=False)
    assert summary.steps == 2 and math.isfinite(summary.loss) and summary.tau_hat >= 1.0
    assert (tmp_path / "t" / "drafters" / algo / "checkpoints" / "step-2" / ckpt.DRAFTER_FILE).is_file()


def killable(monkeypatch, base: DrafterSpec) -> dict:
    """Register `base` so that its drafter raises KeyboardInterrupt (a killed run) on its
    kill["at"]-th training forward; kill["at"] = None never."""
    kill: dict = {"at": None}

    def build(*args):
        module = base.build(*args)
        forward, calls = module.forward, [0]

        def forward_or_die(batch):
            calls[0] += module.training
            if module.training and calls[0] == kill["at"]:
                raise KeyboardInterrupt
            return forward(batch)

        module.forward = forward_or_die
        return module

    monkeypatch.setitem(DRAFTERS, "dflash", dataclasses.replace(base, build=build))
    return kill


@fault(
    stage="train",
    fault="a run interrupted mid-step (before and after its metrics line), then `--resume`",
    result="metrics and final weights identical to an uninterrupted run",
)
@pytest.mark.parametrize("drafter", ["toy", "dflash"])
def test_interrupted_then_resumed_run_matches_uninterrupted(tmp_path, offline, monkeypatch, drafter):
    kill = killable(monkeypatch, use_toy_drafter()["dflash"] if drafter == "toy" else DRAFTERS["dflash"])
    reference = tiny_recipe(tmp_path / "ref")
    run_training(reference, progress=False)

    def strip(records):
        return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in records]

    for kill_at in (4, 5):  # killed before / after step 4 reached metrics.jsonl; checkpoint at 3
        recipe = tiny_recipe(tmp_path / f"kill{kill_at}")
        kill["at"] = kill_at
        with pytest.raises(KeyboardInterrupt):
            run_training(recipe, progress=False)
        root = recipe.run_dir / "drafters" / "dflash" / "checkpoints"
        assert ckpt.latest_checkpoint(root).name == "step-3"
        assert len(train_lines(read_metrics(recipe))) == kill_at - 1
        kill["at"] = None
        summary = run_training(recipe, resume=True, progress=False)
        assert summary.steps == 6
        assert strip(read_metrics(recipe)) == strip(read_metrics(reference))  # exactly; each step once
        a = ckpt.load_drafter_state(reference.run_dir / "drafters" / "dflash" / "checkpoints" / "step-6")
        b = ckpt.load_drafter_state(root / "step-6")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_extends_a_finished_run(tmp_path, offline, toy):
    run_training(tiny_recipe(tmp_path, max_steps=4, save_every=4, eval_every=4), progress=False)
    summary = run_training(
        tiny_recipe(tmp_path, max_steps=6, save_every=4, eval_every=4), resume=True, progress=False
    )
    assert summary.steps == 6
    assert [r["step"] for r in train_lines(read_metrics(tiny_recipe(tmp_path)))] == [1, 2, 3, 4, 5, 6]
    done = run_training(tiny_recipe(tmp_path, max_steps=6), resume=True, progress=False)  # nothing left
    assert done.steps == 6 and done.loss == summary.loss


def drawing(monkeypatch, base: DrafterSpec) -> None:
    """Register `base` so that its drafter draws once from Python's `random` and once from numpy's
    global RNG on each training forward (a drafter that samples with them)."""

    def build(*args):
        module = base.build(*args)
        forward = module.forward

        def forward_and_draw(batch):
            if module.training:
                random.random()
                np.random.random_sample()
            return forward(batch)

        module.forward = forward_and_draw
        return module

    monkeypatch.setitem(DRAFTERS, "dflash", dataclasses.replace(base, build=build))


def saved_rngs(recipe: Recipe, step: int) -> tuple[tuple, list[int], int]:
    """The Python and numpy RNG states of step `step`'s checkpoint: (python, numpy keys, numpy pos)."""
    path = recipe.run_dir / "drafters" / "dflash" / "checkpoints" / f"step-{step}" / ckpt.TRAINER_FILE
    rng = torch.load(path, weights_only=True)["rng"]
    return rng["python"], rng["numpy"][1].tolist(), rng["numpy"][2]


def test_checkpoints_save_the_python_and_numpy_rngs_seeded_and_advanced_by_training_only(
    tmp_path, offline, monkeypatch
):
    """Training seeds Python's `random` and numpy's global RNG from train.seed, as it seeds torch's:
    a checkpoint saves (and a resume restores) those seeded states advanced by what training drew
    (here one draw of each per training forward, none at validation), whatever the process drew
    before. Unseeded, they were the interpreter's start-up states from OS entropy plus whatever any
    import drew (rich.style draws one getrandbits(24)): different in every run of the same recipe."""
    drawing(monkeypatch, use_toy_drafter()["dflash"])
    whole = tiny_recipe(tmp_path / "whole", seed=7)  # 6 steps of one forward, checkpoints at 3 and 6
    random.seed(123), random.random(), np.random.seed(123), np.random.random_sample()  # the process's draws
    run_training(whole, progress=False)
    python, numpy = random.Random(7), np.random.RandomState(7)
    for step in (3, 6):
        for _ in range(3):
            python.random(), numpy.random_sample()
        _, keys, pos, *_ = numpy.get_state()
        assert saved_rngs(whole, step) == (python.getstate(), keys.tolist(), pos)

    # interrupted after step 3 (a new process: other states), then resumed: the same draws follow
    run_training(tiny_recipe(tmp_path / "split", seed=7, max_steps=3), progress=False)
    random.seed(999), np.random.seed(999)
    run_training(tiny_recipe(tmp_path / "split", seed=7), resume=True, progress=False)
    assert saved_rngs(tiny_recipe(tmp_path / "split"), 6) == saved_rngs(whole, 6)


@fault(
    stage="train",
    fault="`--resume` with no checkpoint",
    result="SpecctlError `no checkpoint to resume from`",
)
def test_resume_without_checkpoint_says_so(tmp_path, offline, toy):
    with pytest.raises(SpecctlError, match="no checkpoint to resume from"):
        run_training(tiny_recipe(tmp_path), resume=True, progress=False)


@fault(
    stage="train",
    fault="`--resume` after the drafter section changed in a way the weights' shapes do not show "
    "(a DFlash block of 4 resumed as a block of 3)",
    result="SpecctlError naming the field, its old and new value, and both ways out; nothing written",
)
def test_resume_refuses_a_checkpoint_of_another_drafter(tmp_path, offline):
    block4 = {**TINY_DRAFTERS["dflash"], "block_size": 4}
    run_training(tiny_recipe(tmp_path, extra={"drafter": {"dflash": block4}}, max_steps=3), progress=False)
    root = tmp_path / "t" / "drafters" / "dflash"
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    block3 = tiny_recipe(tmp_path, extra={"drafter": {"dflash": {**block4, "block_size": 3}}}, max_steps=6)
    with pytest.raises(
        SpecctlError,
        match=r"step-3: trained as another dflash drafter .*"
        r"drafter\.dflash\.block_size: 4 -> 3.*recipe\.yaml --resume.*with --restart to start over",
    ):
        run_training(block3, resume=True, progress=False)
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == before
    # training settings may change: the same drafter resumes with more steps and another lr
    more = tiny_recipe(tmp_path, extra={"drafter": {"dflash": block4}}, max_steps=6, lr=1e-3)
    assert run_training(more, resume=True, progress=False).steps == 6


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _rewrite(path: Path, text: str) -> None:
    """Replace a checkpoint file and its checksums (a damage checksums do not catch)."""
    path.write_text(text)
    ckpt.write_checksums(path.parent)


DAMAGES = {  # what breaks the latest checkpoint -> why resume skips it
    "flipped drafter byte": (
        lambda c: _flip_byte(c / ckpt.DRAFTER_FILE),
        r"drafter\.safetensors: checksum mismatch \(corrupted\)",
    ),
    "broken meta.json": (lambda c: (c / ckpt.META_FILE).write_text("{"), r"meta\.json: checksum mismatch"),
    "meta.json a list": (lambda c: _rewrite(c / ckpt.META_FILE, "[]"), r"meta\.json: holds a JSON list"),
    "recipe.yaml not YAML": (
        lambda c: _rewrite(c / ckpt.RECIPE_FILE, "drafter: [unclosed\n"),
        r"recipe\.yaml: unreadable \(while parsing",
    ),
    "optimizer.pt missing": (lambda c: (c / ckpt.OPTIMIZER_FILE).unlink(), r"incomplete: no optimizer\.pt"),
}


@fault(
    stage="train",
    fault="the latest checkpoint is damaged: a flipped byte in its drafter, a torn meta.json, a "
    "meta.json or recipe.yaml that does not parse, a file missing",
    result="`--resume` says in one line which checkpoint it skipped and why, continues from the one "
    "before and ends as an uninterrupted run",
)
@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_resume_falls_back_past_a_damaged_latest_checkpoint(tmp_path, offline, toy, capsys, damage):
    recipe = tiny_recipe(tmp_path)  # checkpoints at steps 3 and 6
    run_training(recipe, progress=False)
    root = recipe.run_dir / "drafters" / "dflash" / "checkpoints"
    want, records = _saved_state(root / "step-6"), read_metrics(recipe)
    break_it, why = DAMAGES[damage]
    break_it(root / "step-6")
    capsys.readouterr()
    summary = run_training(recipe, resume=True, progress=False)
    skipped = [line for line in capsys.readouterr().err.splitlines() if "skipped" in line]
    line = rf"{re.escape(str(root / 'step-6'))}: skipped for resume \({why}.*\); trying the checkpoint before"
    assert len(skipped) == 1 and re.fullmatch(line + " it", skipped[0])
    assert summary.steps == 6 and summary.checkpoint == root / "step-6"
    got = _saved_state(root / "step-6")
    assert _same(want[0], got[0]) and _same(want[1], got[1])  # steps 4-6 again, from step-3: the same
    strip = lambda rs: [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rs]  # noqa: E731
    assert strip(read_metrics(recipe)) == strip(records)
    assert ckpt.checkpoint_problem(root / "step-6") is None  # re-saved whole


@fault(
    stage="train",
    fault="every checkpoint of a run is damaged (or `latest` names a damaged one and none is older)",
    result="`--resume` stops with one CheckpointError listing each checkpoint and why; nothing trained",
)
def test_resume_with_no_checkpoint_that_verifies_is_one_line(tmp_path, offline, toy):
    recipe = tiny_recipe(tmp_path)
    run_training(recipe, progress=False)
    root = recipe.run_dir / "drafters" / "dflash" / "checkpoints"
    _flip_byte(root / "step-6" / ckpt.OPTIMIZER_FILE)
    (root / "step-3" / ckpt.META_FILE).write_text("{}")
    metrics = read_metrics(recipe)
    with pytest.raises(
        CheckpointError,
        match=rf"^{re.escape(str(root))}: no checkpoint verifies \(step-6 \(optimizer\.pt: checksum mismatch "
        r"\(corrupted\)\); step-3 \(meta\.json: checksum mismatch \(corrupted\)\)\); train with --restart",
    ) as e:
        run_training(recipe, resume=True, progress=False)
    assert "\n" not in str(e.value) and read_metrics(recipe) == metrics


def test_resume_candidates_follow_latest_and_ignore_newer_leftovers(tmp_path):
    root = tmp_path / "checkpoints"
    for n in (2, 4, 6, 8):
        (root / f"step-{n}").mkdir(parents=True)
        for name in ckpt.REQUIRED:
            (root / f"step-{n}" / name).write_text("")
    (root / "step-5").mkdir()  # incomplete: never a fallback
    assert [p.name for p in ckpt.resume_candidates(root)] == ["step-8", "step-6", "step-4", "step-2"]
    (root / ckpt.LATEST).write_text("step-6\n")  # step-8: left by another, longer run
    assert [p.name for p in ckpt.resume_candidates(root)] == ["step-6", "step-4", "step-2"]
    (root / ckpt.LATEST).write_text("step-5\n")  # named though incomplete: reported, then the ones below
    assert [p.name for p in ckpt.resume_candidates(root)] == ["step-5", "step-4", "step-2"]


def test_drafter_settings_hold_only_what_defines_the_drafter(tmp_path):
    base = ckpt.drafter_settings(tiny_recipe(tmp_path), "dflash")
    other = tiny_recipe(tmp_path, extra={"drafter": {"eagle3": {"ttt_steps": 5}}}, lr=1.0, max_steps=9)
    assert ckpt.drafter_settings(other, "dflash") == base  # another algorithm's section, training settings
    vocab = ckpt.drafter_settings(tiny_recipe(tmp_path, extra={"drafter": {"draft_vocab_size": 7}}), "dflash")
    assert config_diff(base, vocab) == "drafter.draft_vocab_size: null -> 7"


@fault(
    stage="train",
    fault="the training loss turns NaN",
    result="SpecctlError naming the step, before the optimizer applies it",
)
def test_nan_loss_fails_fast_naming_the_step(tmp_path, offline, toy):
    toy.nan_at = 2
    with pytest.raises(SpecctlError, match=r"^step 2: training loss is nan"):
        run_training(tiny_recipe(tmp_path), progress=False)


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor in a nested state (dicts in key order, lists in order)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors(obj[k])]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []


def _saved_state(path: Path) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(drafter tensors, optimizer moments) of a checkpoint, the learning rates aside."""
    drafter = ckpt.load_drafter_state(path)
    optim = torch.load(path / ckpt.OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    # clone: safetensors may map the file, and a test damages it in place afterwards
    return [drafter[k].clone() for k in sorted(drafter)], _tensors(optim["state"])


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@fault(
    stage="train",
    fault="NaN gradients under a finite loss (an overflow in the backward), with and without clipping",
    result="the step is skipped: weights and optimizer state unchanged, the LR schedule moves on, "
    "`skipped_steps` in metrics.jsonl and a warning line; every checkpoint is finite",
)
@pytest.mark.parametrize("grad_clip", [1.0, 0.0])
def test_nan_gradients_skip_the_step_and_never_reach_the_weights(tmp_path, offline, toy, capsys, grad_clip):
    toy.nan_grad_at = frozenset({3})
    recipe = tiny_recipe(tmp_path, grad_clip=grad_clip, save_every=1, keep_checkpoints=6)
    assert run_training(recipe, progress=False).steps == 6
    train = train_lines(read_metrics(recipe))
    assert [r["skipped_steps"] for r in train] == [0, 0, 1, 1, 1, 1]
    assert ["grad_norm" in r for r in train] == [True, True, False, True, True, True]
    assert all(math.isfinite(r["loss"]) for r in train)
    cfg = recipe.train
    lrs = [lr_at(i, cfg.lr, cfg.warmup_steps, 6, cfg.schedule, cfg.min_lr_ratio) for i in range(6)]
    assert [r["lr"] for r in train] == pytest.approx(lrs)  # the schedule did not stall
    root = recipe.run_dir / "drafters" / "dflash" / "checkpoints"
    states = {n: _saved_state(root / f"step-{n}") for n in range(1, 7)}
    saved = [t for drafter, optim in states.values() for t in drafter + optim if t.is_floating_point()]
    assert all(bool(t.isfinite().all()) for t in saved)
    assert _same(states[2][0], states[3][0]) and _same(states[2][1], states[3][1])  # step 3 applied nothing
    assert not _same(states[3][0], states[4][0])  # step 4 trained again
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "gradients not finite" in line]
    assert len(warnings) == 1 and re.match(
        r"warning: step 3: gradients not finite \(norm nan\) with a finite loss \(.*\); step skipped, "
        r"weights unchanged \(1 in a row, 1 in all; train\.max_skipped_steps=10",
        warnings[0],
    )


@fault(
    stage="train",
    fault="NaN gradients `train.max_skipped_steps` steps in a row (also across a resume)",
    result="SpecctlError naming the step and the streak; nothing was applied, so the checkpoints "
    "are finite and a resumed run counts the streak where it stopped",
)
def test_nan_gradients_in_a_row_stop_the_run_naming_the_step(tmp_path, offline, toy):
    toy.nan_grad_at = frozenset({2, 4, 5, 6})  # one skip, a good step, then three in a row
    recipe = tiny_recipe(tmp_path, max_steps=8, max_skipped_steps=3, save_every=1, keep_checkpoints=8)
    stop = r"^step 6: gradients not finite \(NaN/Inf\) 3 steps in a row \(steps 4-6\), none applied"
    with pytest.raises(SpecctlError, match=stop) as e:
        run_training(recipe, progress=False)
    assert "\n" not in str(e.value)
    root = recipe.run_dir / "drafters" / "dflash" / "checkpoints"
    assert ckpt.latest_checkpoint(root).name == "step-5"
    assert [r["skipped_steps"] for r in train_lines(read_metrics(recipe))] == [0, 1, 1, 2, 3]
    three, five = _saved_state(root / "step-3"), _saved_state(root / "step-5")
    assert _same(three[0], five[0]) and _same(three[1], five[1])
    assert all(bool(t.isfinite().all()) for t in five[0] + five[1] if t.is_floating_point())

    toy.nan_grad_at = frozenset({1})  # the resumed run's first step: step 6, the third in a row again
    with pytest.raises(SpecctlError, match=stop):
        run_training(recipe, resume=True, progress=False)
    toy.nan_grad_at = frozenset()
    assert run_training(recipe, resume=True, progress=False).steps == 8
    assert [r["skipped_steps"] for r in train_lines(read_metrics(recipe))] == [0, 1, 1, 2, 3, 3, 3, 3]


@fault(
    stage="train",
    fault="no loss-masked token in any sample",
    result="DataError at step 1 instead of a silent zero loss",
)
def test_nothing_to_train_on_fails_fast(tmp_path, monkeypatch):
    _, _, samples = tiny_world()
    unmasked = [{**s, "loss_mask": torch.zeros_like(s["loss_mask"])} for s in samples]
    monkeypatch.setattr(train_mod, "open_source", lambda recipe, ctx, progress: tiny_source(unmasked))
    with pytest.raises(DataError, match=r"^step 1: the drafter found nothing to train on"):
        run_training(tiny_recipe(tmp_path), progress=False)  # the real DFlash: no anchors anywhere


def test_muon_with_gradient_accumulation_trains(tmp_path, offline, toy):
    recipe = tiny_recipe(
        tmp_path,
        optimizer="muon",
        grad_accum=2,
        loss="ce",
        max_steps=10,
        eval_every=10,
        save_every=10,
        lr=2e-2,
    )
    run_training(recipe, progress=False)
    losses = [r["loss"] for r in train_lines(read_metrics(recipe))]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.25
    optim = torch.load(
        ckpt.latest_checkpoint(recipe.run_dir / "drafters" / "dflash" / "checkpoints") / ckpt.OPTIMIZER_FILE,
        weights_only=True,
    )
    assert "momentum_buffer" in optim["state"]["fc.weight"] and "exp_avg" in optim["state"]["fc.bias"]


def test_draft_vocab_from_token_frequencies(tmp_path, offline, monkeypatch):
    freq = torch.zeros(VOCAB, dtype=torch.long)
    freq[3:35] = torch.arange(32, 0, -1)  # the ids the samples use, plus the most frequent others
    monkeypatch.setattr(train_mod, "load_token_freq", lambda data_dir, vocab_size: freq)
    recipe = tiny_recipe(
        tmp_path, max_steps=2, save_every=2, eval_every=2, extra={"drafter": {"draft_vocab_size": 48}}
    )
    run_training(recipe, progress=False)
    state = ckpt.load_drafter_state(recipe.run_dir / "drafters" / "dflash" / "checkpoints" / "step-2")
    assert torch.equal(state["d2t"], build_draft_vocab(freq, 48)[0])
    assert state["lm_head.weight"].shape == (48, HIDDEN)


@fault(
    stage="train",
    fault="feature store missing, incomplete, or from another hidden size, aux layers or verifier config",
    result="FeatureStoreError naming the mismatch and the command that fixes it",
)
def test_feature_store_mismatches_fail_fast(tmp_path):
    spec, _, samples = tiny_world()
    path = tmp_path / "features"
    with pytest.raises(
        FeatureStoreError, match=r"no feature store; run `specctl collect-hidden-states RECIPE`"
    ):
        train_mod.open_store(path, spec)
    lengths = [len(s["input_ids"]) for s in samples[:4]]
    plan = StorePlan(
        "tiny-llama", "abc123", LAYERS, HIDDEN, list(AUX), "bfloat16", "d", lengths, [[0, 2], [2, 4]]
    )
    init_store(path, plan)
    write_shard(path, 0, samples[:2], "bfloat16")
    with pytest.raises(FeatureStoreError, match="incomplete feature store"):
        train_mod.open_store(path, spec)
    write_shard(path, 1, samples[2:4], "bfloat16")
    finalize_store(path)
    assert len(train_mod.open_store(path, spec, "abc123")) == 4
    with pytest.raises(
        FeatureStoreError, match=r"hidden size 64 \(verifier tiny-llama\) but verifier big has 128"
    ):
        train_mod.open_store(path, dataclasses.replace(spec, hidden_size=128, name_or_path="big"))
    with pytest.raises(
        FeatureStoreError, match=r"aux layers \[1, 2, 3\] but the recipe asks for \[2, 3, 4\]"
    ):
        train_mod.open_store(path, dataclasses.replace(spec, aux_layer_ids=(2, 3, 4)))
    with pytest.raises(
        FeatureStoreError, match=r"config abc123\) but the recipe's verifier tiny-llama has config ff"
    ):
        train_mod.open_store(path, spec, "ff")


def test_collect_then_offline_and_online_training_see_the_same_batches(tmp_path, tiny_verifier_dir):
    """The real pipeline pieces: data stage, collect-hidden-states, verifier; offline (fp32 store)
    and online training start from the same data and give the same losses."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(12):
        T = int(torch.randint(12, 30, (1,), generator=g))
        rows.append(
            {
                "input_ids": torch.randint(3, 40, (T,), generator=g).tolist(),
                "loss_mask": [0] * (T // 3) + [1] * (T - T // 3),
            }
        )
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    extra = {
        "verifier": {"name_or_path": str(tiny_verifier_dir)},
        "data": {"source": str(data)},
        "features": {"dtype": "float32"},
        "drafter": {"draft_vocab_size": 64},
    }
    steps = dict(max_steps=3, eval_every=3, save_every=3, loss="ce", lr=1e-2)  # ce: moves with the features
    offline = tiny_recipe(tmp_path, name="offline", extra=extra, **steps)
    collect(offline, progress=False)
    a = run_training(offline, progress=False)
    online = tiny_recipe(tmp_path, name="online", extra=extra, mode="online", **steps)
    b = run_training(online, progress=False)
    assert (tmp_path / "offline" / "features" / "manifest.json").is_file()
    assert not (tmp_path / "online" / "features").exists()  # online writes no features
    la, lb = train_lines(read_metrics(offline)), train_lines(read_metrics(online))
    assert [r["loss"] for r in la] == pytest.approx([r["loss"] for r in lb], rel=1e-5)
    assert a.val_loss == pytest.approx(b.val_loss, rel=1e-5)
    state = ckpt.load_drafter_state(b.checkpoint)
    freq = load_token_freq(tmp_path / "online" / "data", 320)
    assert torch.equal(state["d2t"], build_draft_vocab(freq, 64)[0])
    meta = ckpt.read_meta(a.checkpoint)
    assert meta["verifier"]["aux_layer_ids"] == list(AUX) and meta["verifier"]["vocab_size"] == 320


def test_report_to_tensorboard_gets_every_metrics_line(tmp_path, offline, toy):
    """train.report_to=tensorboard (accelerate's TensorBoardTracker): the event files hold the
    same loss / tau_hat / per-position accuracy as metrics.jsonl, at the same steps, and the
    recipe as hyperparameters."""
    pytest.importorskip("tensorboard")  # the dev extra installs it (make test)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recipe = tiny_recipe(tmp_path, max_steps=3, report_to="tensorboard")
    run_training(recipe, progress=False)
    logdir = recipe.run_dir / "drafters" / "dflash" / "tensorboard"
    events = EventAccumulator(str(logdir))
    events.Reload()
    series = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    records = read_metrics(recipe)
    assert series["loss"] == pytest.approx({r["step"]: r["loss"] for r in train_lines(records)})
    val = val_lines(records)
    assert series["tau_hat"] == pytest.approx({r["step"]: r["tau_hat"] for r in val})
    acc = val[-1]["val_acc_per_position"]
    for i, a in enumerate(acc):
        assert series[f"val_acc_per_position/{i + 1}"][val[-1]["step"]] == pytest.approx(a)
    assert "step" not in series
    assert list(logdir.glob("*/hparams.yml"))  # the recipe, flattened


def test_report_to_a_missing_tracker_fails_before_training(tmp_path, offline, toy, monkeypatch):
    import importlib.util

    from specctl.train import tracking

    real = importlib.util.find_spec
    monkeypatch.setattr(
        tracking.importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    recipe = tiny_recipe(tmp_path, report_to="wandb")
    with pytest.raises(SpecctlError, match=r"train.report_to: wandb needs the wandb package: pip install"):
        run_training(recipe, progress=False)
    assert not (recipe.run_dir / "drafters").exists()  # nothing trained, nothing written
    with pytest.raises(Exception, match="report_to"):
        tiny_recipe(tmp_path, report_to="mlflow")  # not a choice: the recipe refuses it


def test_tracker_scalars_and_flat_config():
    from specctl.train.tracking import flat_config, scalars

    record = {"step": 4, "loss": 2.5, "val_acc_per_position": [0.5, 0.25], "bad": float("nan"), "ok": True}
    assert scalars(record) == {"loss": 2.5, "val_acc_per_position/1": 0.5, "val_acc_per_position/2": 0.25}
    tree = {"train": {"lr": 1e-3, "betas": [0.9, 0.95]}, "name": "x", "data": {"subset": None}}
    assert flat_config(tree) == {
        "train.lr": 1e-3,
        "train.betas": "[0.9, 0.95]",
        "name": "x",
        "data.subset": None,
    }


@fault(
    stage="train",
    fault="metrics.jsonl whose last line was cut off (kill or full disk mid-append)",
    result="resume keeps every whole record up to the checkpoint and drops the torn line",
)
def test_resume_tolerates_a_torn_last_metrics_line(tmp_path):
    from specctl.train.loop import MetricsLog

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.5}\n{"step": 3, "lo')
    log = MetricsLog(path, True).open(keep_until=2)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]
    assert log.last["loss"] == 2.5
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())


# ---------------------------------------------------------------- precision


@pytest.mark.parametrize(
    ("device", "setting", "native", "want"),
    [
        ("cpu", "auto", True, torch.bfloat16),
        ("cpu", "auto", False, torch.float32),
        ("cpu", "float32", True, torch.float32),
        ("cpu", "bfloat16", False, torch.bfloat16),
        ("cuda", "auto", False, torch.bfloat16),
        ("cuda", "float32", True, torch.float32),
    ],
)
def test_precision_auto_is_bf16_where_the_hardware_has_it(monkeypatch, device, setting, native, want):
    from specctl import devices

    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: native)
    assert devices.compute_dtype(torch.device(device), setting) == want
    with pytest.raises(ValueError, match="precision"):
        devices.compute_dtype(torch.device(device), "fp8")


@pytest.mark.parametrize(
    ("device", "setting", "native", "ours", "vllm"),
    [
        ("cpu", "auto", True, torch.float32, None),  # exact plain-vs-spec; vLLM picks bf16 itself
        ("cpu", "auto", False, torch.float32, "float32"),  # vLLM would pick an emulated bf16
        ("cpu", "bfloat16-if-native", True, torch.bfloat16, "bfloat16"),
        ("cpu", "bfloat16-if-native", False, torch.float32, "float32"),
        ("cpu", "bfloat16", False, torch.bfloat16, "bfloat16"),  # asked for: given, even emulated
        ("cuda", "auto", False, torch.bfloat16, None),
        ("cuda", "bfloat16-if-native", False, torch.bfloat16, "bfloat16"),
        ("cuda", "float16", True, torch.float16, "float16"),
    ],
)
def test_verifier_dtype_is_bf16_only_where_the_hardware_has_it(
    monkeypatch, device, setting, native, ours, vllm
):
    """verifier.dtype for specctl's own forward (resolve_dtype) and for a vLLM engine (vllm_dtype)."""
    from specctl import devices

    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: native)
    assert devices.resolve_dtype(setting, torch.device(device)) == ours
    assert devices.vllm_dtype(setting, torch.device(device)) == vllm


def test_bf16_training_learns_resumes_exactly_and_records_its_dtype(tmp_path, offline, monkeypatch):
    """bf16 autocast on the CPU: the loss falls as in float32, a resumed run repeats an uninterrupted
    one bit for bit, and the checkpoint says what the run computed in."""
    steps = dict(precision="bfloat16", max_steps=12, eval_every=6, save_every=6, lr=1e-2, loss="ce")
    bf16 = run_training(tiny_recipe(tmp_path / "bf16", **steps), progress=False)
    fp32 = run_training(tiny_recipe(tmp_path / "fp32", **{**steps, "precision": "float32"}), progress=False)
    first = train_lines(read_metrics(tiny_recipe(tmp_path / "bf16")))[0]["loss"]
    assert bf16.loss < 0.95 * first and bf16.loss == pytest.approx(fp32.loss, rel=0.05)
    meta = json.loads((bf16.checkpoint / ckpt.META_FILE).read_text())
    assert meta["compute_dtype"] == "bfloat16"

    kill = killable(monkeypatch, DRAFTERS["dflash"])
    kill["at"] = 8  # step 8 of 12; checkpoint at 6
    with pytest.raises(KeyboardInterrupt):
        run_training(tiny_recipe(tmp_path / "resumed", **steps), progress=False)
    kill["at"] = None
    resumed = run_training(tiny_recipe(tmp_path / "resumed", **steps), resume=True, progress=False)
    assert resumed.loss == bf16.loss and resumed.tau_hat == bf16.tau_hat


def test_metrics_count_training_tokens_for_the_learning_curve(tmp_path, offline):
    """Every record carries tokens_seen, the training tokens consumed so far (the x axis of a
    learning curve): train records grow by each step's real tokens, and a validation record has the
    count of the step it follows."""
    recipe = tiny_recipe(tmp_path, max_steps=6, eval_every=2)
    run_training(recipe, progress=False)
    records = read_metrics(recipe)
    train = train_lines(records)
    seen = [r["tokens_seen"] for r in train]
    assert seen == sorted(set(seen)) and seen[0] > 0
    # tokens_per_s * step time is not logged; bound each step by the micro-batch budget instead
    steps = [b - a for a, b in zip([0, *seen], seen, strict=False)]
    assert all(0 < n <= recipe.train.batch_tokens for n in steps)
    by_step = {r["step"]: r["tokens_seen"] for r in train}
    vals = [r for r in records if "tau_hat" in r]
    assert [r["step"] for r in vals] == [2, 4, 6]
    assert all(r["tokens_seen"] == by_step[r["step"]] for r in vals)
    # the curve the stage plots is those validations, in order
    from specctl.train.curves import read_curve

    out_dir = recipe.run_dir / "drafters" / "dflash"
    curve = read_curve(out_dir / "metrics.jsonl")
    assert curve.tokens == [by_step[s] for s in (2, 4, 6)]
    assert curve.tau_hat == [r["tau_hat"] for r in vals] and len(curve.accuracy[0]) == 3
    png = (out_dir / "learning-curve.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000


# ---------------------------------------------------------------- input: verifier tensors, loader, store


def collected_recipe(tmp_path, verifier_dir, name: str = "c", **train) -> Recipe:
    """A recipe on a verifier saved on disk, with its feature store collected (several shards)."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(12):
        T = int(torch.randint(12, 30, (1,), generator=g))
        ids = torch.randint(3, 40, (T,), generator=g).tolist()
        rows.append({"input_ids": ids, "loss_mask": [0] * (T // 3) + [1] * (T - T // 3)})
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    extra = {
        "verifier": {"name_or_path": str(verifier_dir)},
        "data": {"source": str(data)},
        "features": {"shard_tokens": 100},
    }
    steps = dict(max_steps=3, eval_every=3, save_every=3)
    recipe = tiny_recipe(tmp_path, name=name, extra=extra, **{**steps, **train})
    collect(recipe, progress=False)
    assert len(list((recipe.run_dir / "features").glob("shard-*.safetensors"))) > 2
    return recipe


def test_offline_training_never_materializes_the_verifiers_decoder_layers(tmp_path, monkeypatch):
    """Checked, not assumed: with every way of building an HF model refusing, and every tensor read
    through safetensors recorded, offline training runs and reads the embeddings, final norm and LM
    head of the verifier, and no `model.layers.*` tensor."""
    import safetensors.torch
    import transformers
    from conftest import make_tiny_tokenizer, make_tiny_verifier

    from specctl import features, hf_weights

    verifier_dir = tmp_path / "verifier"
    make_tiny_verifier().save_pretrained(verifier_dir, max_shard_size="100KB")  # index + shards
    make_tiny_tokenizer().save_pretrained(verifier_dir)
    recipe = collected_recipe(tmp_path, verifier_dir)  # collect runs the model; training must not

    def refuse(*args, **kwargs):
        raise AssertionError("offline training built or loaded the verifier model")

    monkeypatch.setattr(transformers.PreTrainedModel, "__init__", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", refuse)
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    read: list[tuple[str, str]] = []  # (file, tensor)

    class Recording:
        def __init__(self, file, *args, **kwargs):
            self.file, self.handle = Path(file).name, safetensors.safe_open(file, *args, **kwargs)

        def __enter__(self):
            self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def get_tensor(self, name):
            read.append((self.file, name))
            return self.handle.get_tensor(name)

        def get_slice(self, name):
            read.append((self.file, name))
            return self.handle.get_slice(name)

        def keys(self):
            return self.handle.keys()

    monkeypatch.setattr(hf_weights, "safe_open", Recording)
    monkeypatch.setattr(features, "safe_open", Recording)
    summary = run_training(recipe, progress=False)
    assert summary.steps == 3 and math.isfinite(summary.loss)
    from_verifier = {name for file, name in read if file.startswith("model")}
    assert from_verifier == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    assert not [name for _, name in read if name.startswith("model.layers.")]
    assert any(file.startswith("shard-") for file, _ in read)  # the store was read through it too


def test_step_sampler_yields_the_micro_batches_each_step_takes():
    """This rank's DataLoader order = the old loop's: per step, rank_share of the step's W*A
    micro-batches of the stream, from any resumed cursor, across epochs (7 buckets, uneven)."""
    buckets = [[i, i + 100] for i in range(7)]
    for W, A in ((1, 1), (1, 3), (2, 1), (2, 2), (3, 2)):
        per_step = W * A
        for start_step in (0, 1, 5):
            start = start_step * per_step
            for rank in range(W):
                want = []
                for s in range(6):  # brute force: the chunk of each step, then this rank's share
                    cursor = start + s * per_step
                    chunk = [micro_batch_at(buckets, cursor + i, seed=3) for i in range(per_step)]
                    want += rank_share(chunk, A, rank)
                got = list(itertools.islice(StepSampler(buckets, 3, W, A, rank, start), 6 * A))
                assert got == want, (W, A, start, rank)


def test_data_workers_train_identically_and_an_interrupted_run_resumes_exactly(
    tmp_path, offline, monkeypatch
):
    """Two loader processes: the same metrics and weights as building batches in the loop, also
    when the run is killed mid-step and resumed; the workers are stopped either way."""
    import multiprocessing

    kill = killable(monkeypatch, DRAFTERS["dflash"])
    reference = tiny_recipe(tmp_path / "ref")
    run_training(reference, progress=False)
    pids, read = tmp_path / "pids", offline.sample

    def sample(i):  # records which process read it
        with pids.open("a") as f:
            f.write(f"{os.getpid()}\n")
        return read(i)

    monkeypatch.setattr(offline, "sample", sample)
    recipe = tiny_recipe(tmp_path / "workers", data_workers=2)
    kill["at"] = 5  # step 5 of 6; checkpoint at 3
    with pytest.raises(KeyboardInterrupt):
        run_training(recipe, progress=False)
    assert multiprocessing.active_children() == []
    kill["at"] = None
    run_training(recipe, resume=True, progress=False)
    assert multiprocessing.active_children() == []

    def strip(records):
        return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in records]

    assert strip(read_metrics(recipe)) == strip(read_metrics(reference))
    a = ckpt.load_drafter_state(reference.run_dir / "drafters" / "dflash" / "checkpoints" / "step-6")
    b = ckpt.load_drafter_state(recipe.run_dir / "drafters" / "dflash" / "checkpoints" / "step-6")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    readers = set(pids.read_text().split())
    assert len(readers - {str(os.getpid())}) >= 2  # training batches came from worker processes


def test_data_workers_default_per_device(monkeypatch):
    from specctl.recipe import CUDA_DATA_WORKERS

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert data_workers(None, cpu) == 0 and data_workers(3, cpu) == 3 and data_workers(0, cuda) == 0
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert data_workers(None, cuda, 8) == CUDA_DATA_WORKERS  # 8 CPUs a rank: one for the rank itself
    assert data_workers(None, cuda, 16) == 3 and data_workers(None, cuda, 32) == 1


def _reference_rows(path, store, i: int) -> dict[str, torch.Tensor]:
    """Sample i of a store as training read it before decoding moved to the device: straight from
    the shard file, fp8 dequantized per row to float32, ids int64, log-probs float32."""
    from safetensors.torch import load_file

    j = max(k for k, (a, _) in enumerate(store.manifest.shards) if a <= i)
    t = load_file(path / store.manifest.shard_files[j]["file"])
    a, b = t["offsets"][i - store.manifest.shards[j][0] : i - store.manifest.shards[j][0] + 2].tolist()
    row = {"input_ids": t["input_ids"][a:b].long(), "loss_mask": t["loss_mask"][a:b].bool()}
    if "aux_scale" in t:
        q, scale = t["aux_hidden_states"][a:b].float(), t["aux_scale"][a:b].float()
        row["aux_hidden_states"] = q * scale[..., None]
    else:
        row["aux_hidden_states"] = t["aux_hidden_states"][a:b]
    for key, cast in (("last_hidden_state", None), ("topk_ids", torch.long), ("target_argmax", torch.long)):
        if key in t:
            row[key] = t[key][a:b] if cast is None else t[key][a:b].to(cast)
    for key in ("topk_logprobs", "logsumexp"):
        if key in t:
            row[key] = t[key][a:b].float()
    return row


LAYOUTS = [
    pytest.param(Layout("bfloat16", "fp8", "hidden", 0, True), id="fp8-aux-hidden-stats"),
    pytest.param(Layout("bfloat16", "fp8", "topk", 4), id="fp8-aux-topk"),
    pytest.param(Layout("bfloat16", "bfloat16"), id="bf16"),
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_stored_rows_decoded_on_the_device_are_the_batches_of_before(tmp_path, layout):
    """Batches cross to the device as stored (fp8 + scales, uint16 ids) and are decoded there:
    the values and dtypes the drafter gets are those of decoding each sample on the host first."""
    spec, weights, samples = tiny_world()
    head = TargetHead(weights.norm.float(), weights.lm_head.float(), spec.rms_norm_eps)
    rows = [
        {**s, **encode_features(s["aux_hidden_states"].float(), s["last_hidden_state"].float(), layout, head)}
        for s in samples[:9]
    ]
    path = tmp_path / "features"
    lengths = [len(s["input_ids"]) for s in rows]
    plan = StorePlan(
        "tiny-llama", "h", LAYERS, HIDDEN, list(AUX), layout.dtype, "d", lengths, [[0, 4], [4, 9]],
        aux_dtype=layout.aux_dtype, target=layout.target, topk=layout.topk, target_stats=layout.target_stats,
    )  # fmt: skip
    init_store(path, plan)
    for j, (a, b) in enumerate(plan.shards):
        write_shard(path, j, rows[a:b], layout)
    finalize_store(path)
    store = open_features(path)
    source = Source(lengths, train_mod.FiniteSamples(store, path), train_mod.identity, spec, weights)
    for indices in ([0, 5, 8], [3], [1, 2, 4, 6, 7]):
        host = collate([source.sample(i) for i in indices], max_tokens=24)
        want = collate([_reference_rows(path, store, i) for i in indices], max_tokens=24)
        want = {
            k: v.float() if k in ("aux_hidden_states", "last_hidden_state") else v for k, v in want.items()
        }
        got = source.on_device(host, torch.device("cpu"))
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
        if layout.aux_dtype == "fp8":  # what crosses: 1 byte an aux element (+ a float32 scale a row)
            assert host["aux_hidden_states"].dtype == torch.float8_e4m3fn and "aux_scale" in host
            assert host["aux_hidden_states"].nbytes * 4 == want["aux_hidden_states"].nbytes
        if layout.target == "topk":
            assert host["topk_ids"].dtype == torch.uint16


def test_each_shard_is_hashed_once_a_run_and_a_corrupted_one_stops_it_first(
    tmp_path, tiny_verifier_dir, monkeypatch
):
    """The store's checksums are checked up front, once per shard (not again by every reader), and
    a flipped byte stops the run before any step, naming the shard."""
    from specctl import features

    recipe = collected_recipe(tmp_path, tiny_verifier_dir)
    hashed: list[str] = []
    real = features.sha256_file
    monkeypatch.setattr(features, "sha256_file", lambda path: hashed.append(Path(path).name) or real(path))
    run_training(recipe, progress=False)
    shards = sorted(p.name for p in (recipe.run_dir / "features").glob("shard-*.safetensors"))
    assert sorted(hashed) == shards

    victim = recipe.run_dir / "features" / shards[1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(FeatureStoreError, match=rf"{shards[1]}: checksum mismatch"):
        run_training(recipe, progress=False)
