"""P-EAGLE drafter: depth-row sampling, block layout vs brute force, serving agreement, export, overfit."""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

import pytest
import torch
from pydantic import ValidationError
from test_eagle3 import (
    AUX,
    HIDDEN,
    VOCAB,
    check_vllm_weights,
    embedded_acceptance,
    greedy_dataset,
    load_into_vllm,
    overfit,
    pad_tail,
    tiny_verifier,
    verifier_batch,
    vllm_acceptance,
)

from specctl.drafters.api import greedy_propose
from specctl.drafters.layers import Attention, shared_key_bias
from specctl.drafters.peagle import (
    SPEC,
    Config,
    block_attention,
    block_layout,
    sample_draft_blocks,
)
from specctl.drafters.peagle import build as build_peagle
from specctl.drafters.targets import build_draft_vocab, draft_to_target, verifier_logits


def build(config, spec, weights, d2t=None, loss="kl"):
    return build_peagle(config, spec, weights, d2t, loss)


def from_export(cfg: dict, tensors: dict, weights):
    """The drafter a config.json object and its tensors describe (the path every loader takes)."""
    return SPEC.from_export(SPEC.format_cls.from_json(cfg), tensors, weights)


@pytest.fixture(scope="module")
def verifier():
    return tiny_verifier()


@pytest.fixture(scope="module")
def batch(verifier):
    model, _, _ = verifier
    ids = torch.randint(0, VOCAB - 1, (3, 24), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[:, 5:] = True
    loss_mask[0, 13:16] = False  # a user turn inside the first conversation
    return pad_tail(verifier_batch(model, ids, loss_mask), row=2, length=16)


def valid_table(batch: dict[str, torch.Tensor], depths: int) -> torch.Tensor:
    """Brute force [K, B, R]: row t's depth-d target x_{t+2+d} is a real assistant token."""
    B, T = batch["input_ids"].shape
    valid = torch.zeros(depths, B, T - 1, dtype=torch.bool)
    for d in range(depths):
        for b in range(B):
            for t in range(T - 1):
                j = t + 2 + d
                valid[d, b, t] = j < T and bool(batch["loss_mask"][b, j] and batch["attention_mask"][b, j])
    return valid


# ---------------------------------------------------------------- sparsification


def test_depth_counts_follow_the_geometric_rule():
    valid = torch.ones(8, 1000, dtype=torch.bool)
    g = torch.Generator().manual_seed(0)
    kept = sample_draft_blocks(valid, 0.7, 0.2, generator=g)
    # floor(1000 * max(0.7**d, 0.2)), d = 1..7
    assert [k.numel() for k in kept] == [700, 490, 343, 240, 200, 200, 200]
    capped = sample_draft_blocks(valid, 0.7, 0.2, max_anchors=100, generator=g)
    assert [k.numel() for k in capped] == [70, 49, 34, 24, 20, 20, 20]
    assert [k.numel() for k in sample_draft_blocks(valid[:4], 0.5, 0.0, generator=g)] == [500, 250, 125]
    for ks in (kept, capped):
        for shallow, deep in zip(ks, ks[1:], strict=False):
            assert torch.isin(deep, shallow).all()  # nested: a kept row's block rows 1..d-1 exist
            assert torch.equal(deep, deep.sort().values) and deep.unique().numel() == deep.numel()


def test_sampling_respects_validity_and_seed():
    g = torch.Generator().manual_seed(1)
    valid = torch.rand(6, 300, generator=g) < 0.8
    kept = sample_draft_blocks(valid, 0.7, 0.2, generator=torch.Generator().manual_seed(5))
    n = int(valid[0].sum())
    pool = valid[1].nonzero()[:, 0]
    for d, k in enumerate(kept, start=1):
        assert valid[d, k].all()
        if d > 1:
            pool = kept[d - 2][valid[d, kept[d - 2]]]
        assert k.numel() == min(pool.numel(), math.floor(n * max(0.7**d, 0.2) + 1e-9))
    again = sample_draft_blocks(valid, 0.7, 0.2, generator=torch.Generator().manual_seed(5))
    other = sample_draft_blocks(valid, 0.7, 0.2, generator=torch.Generator().manual_seed(6))
    assert all(torch.equal(a, b) for a, b in zip(kept, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(kept, other, strict=True))
    # validation keeps every row whose chain of targets is valid
    everything = sample_draft_blocks(valid, 0.7, 0.2, keep_all=True)
    chain = valid[1].clone()
    for d, k in enumerate(everything, start=1):
        if d > 1:
            chain &= valid[d]
        assert torch.equal(k, chain.nonzero()[:, 0])


# ---------------------------------------------------------------- attention layout


def dense_from_layout(ctx_mask, blk_index, blk_mask, R: int) -> torch.Tensor:
    """[B, M, R+M]: the keys each depth row sees among [real rows, depth rows], from the layout."""
    B, M, J = blk_index.shape
    dense = torch.zeros(B, M, R + M, dtype=torch.bool)
    dense[:, :, :R] = ctx_mask
    for b in range(B):
        for m in range(M):
            for j in range(J):
                if blk_mask[b, m, j]:
                    dense[b, m, R + blk_index[b, m, j]] = True
    return dense


def rows_from_table(valid: torch.Tensor, generator) -> tuple[torch.Tensor, ...]:
    per = []
    for b in range(valid.shape[1]):
        kept = sample_draft_blocks(valid[:, b], 0.7, 0.3, generator=generator)
        per.append((torch.cat(kept), torch.cat([torch.full_like(k, d + 1) for d, k in enumerate(kept)])))
    M = max(a.numel() for a, _ in per)
    anchor, depth = torch.zeros(len(per), M, dtype=torch.long), torch.ones(len(per), M, dtype=torch.long)
    present = torch.zeros(len(per), M, dtype=torch.bool)
    for b, (a, d) in enumerate(per):
        anchor[b, : a.numel()], depth[b, : a.numel()], present[b, : a.numel()] = a, d, True
    return anchor, depth, present


def test_block_layout_matches_brute_force():
    g = torch.Generator().manual_seed(2)
    K, R = 5, 30
    valid = torch.rand(K, 3, R, generator=g) < 0.85
    anchor, depth, present = rows_from_table(valid, g)
    M = anchor.shape[1]
    ctx_mask, blk_index, blk_mask = block_layout(anchor, depth, present, R, K)
    # compact: per depth row, R context flags and K-1 block slots -- nothing (R+M) x (R+M)
    assert ctx_mask.shape == (3, M, R) and blk_index.shape == blk_mask.shape == (3, M, K - 1)
    dense = dense_from_layout(ctx_mask, blk_index, blk_mask, R)
    for b in range(3):
        for m in range(M):
            for j in range(R):
                assert dense[b, m, j] == (j <= anchor[b, m]), (b, m, j)
            for n in range(M):
                # vLLM: slot d of a block sees its anchor's context and slots 1..d of its own block
                expected = bool(
                    present[b, m]
                    and present[b, n]
                    and anchor[b, n] == anchor[b, m]
                    and 1 <= depth[b, n] <= depth[b, m]
                )
                assert dense[b, m, R + n] == expected, (b, m, n)


def test_block_attention_equals_dense_attention():
    torch.manual_seed(0)
    attn = Attention(HIDDEN, 4, 2, 16)
    g = torch.Generator().manual_seed(3)
    for K, R in ((4, 12), (6, 9), (2, 15)):
        valid = torch.rand(K, 2, R, generator=g) < 0.9
        valid[:, 1, R // 2 :] = False  # a shorter sample: padding depth rows in the other
        anchor, depth, present = rows_from_table(valid, g)
        assert not present.all()
        B, M = anchor.shape
        ctx_mask, blk_index, blk_mask = block_layout(anchor, depth, present, R, K)
        q = torch.randn(B, 4, M, 16, requires_grad=True)
        k = torch.randn(B, 2, R + M, 16, requires_grad=True)
        v = torch.randn(B, 2, R + M, 16, requires_grad=True)
        bidx = torch.arange(B)[:, None, None]
        gather = blk_index.clamp(min=0)
        bk = k[:, :, R:].transpose(1, 2)[bidx, gather].permute(0, 3, 1, 2, 4)
        bv = v[:, :, R:].transpose(1, 2)[bidx, gather].permute(0, 3, 1, 2, 4)
        bias = shared_key_bias(ctx_mask, q.dtype)
        ours = block_attention(attn, q, k[:, :, :R], v[:, :, :R], bias, bk, bv, blk_mask)
        dense = dense_from_layout(ctx_mask, blk_index, blk_mask, R)
        reference = attn.attend(q, k, v, dense[:, None])
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
        weights = torch.randn(ours.shape, generator=g)
        got = torch.autograd.grad((ours * weights).sum(), (q, k, v))
        want = torch.autograd.grad((reference * weights).sum(), (q, k, v))
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_bf16_autocast_training_step(verifier, batch):
    """Under autocast the depth rows' context mask is built in bf16 once; the loss stays close
    to float32's and every gradient is finite."""
    _, spec, weights = verifier
    torch.manual_seed(0)
    drafter = build(Config(num_layers=2, num_depths=4, num_speculative_tokens=4), spec, weights).eval()
    full, _ = drafter(batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low, _ = drafter(batch)
    low.backward()
    torch.testing.assert_close(low.float(), full, rtol=1e-2, atol=1e-2)
    assert all(torch.isfinite(p.grad).all() for p in drafter.parameters() if p.grad is not None)


def reference_block_attention(attn, q, ctx_k, ctx_v, ctx_mask, blk_k, blk_v, blk_mask):
    """The former depth-row attention: explicit [M, R + J] scores, masked, one softmax."""
    B, h, M, hd = q.shape
    kvh, R = ctx_k.shape[1], ctx_k.shape[2]
    q = q.view(B, kvh, h // kvh, M, hd) * hd**-0.5
    s_ctx = q @ ctx_k[:, :, None].transpose(-1, -2)  # [B, kvh, rep, M, R]
    s_blk = (q[..., None, :] * blk_k[:, :, None]).sum(-1)  # [B, kvh, rep, M, J]
    mask = torch.cat([ctx_mask, blk_mask], dim=-1)[:, None, None]
    scores = torch.cat([s_ctx, s_blk], dim=-1).float().masked_fill(~mask, float("-inf"))
    p = scores.softmax(-1).to(q.dtype)
    out = p[..., :R] @ ctx_v[:, :, None] + (p[..., R:, None] * blk_v[:, :, None]).sum(-2)
    return attn.o_proj(out.reshape(B, h, M, hd).transpose(1, 2).reshape(B, M, h * hd))


def reference_rows_forward(drafter, input_ids, aux_hidden_states, anchor, depth, present):
    """PEagleDrafter.rows_forward as it was: a dense [R, R] causal mask for the real rows and
    explicit masked scores for the depth rows. Slow; the reference."""
    B, R = aux_hidden_states.shape[:2]
    M = anchor.shape[1]
    ctx_mask, blk_index, blk_mask = block_layout(anchor, depth, present, R, drafter.config.num_depths)
    causal = torch.ones(R, R, dtype=torch.bool).tril()[None, None]
    mask_id = drafter.verifier.mask_token_id
    tokens = torch.cat([input_ids[:, 1 : R + 1], torch.full_like(anchor, mask_id)], 1)
    mask_feature = drafter.combine(drafter.mask_hidden.view(1, *aux_hidden_states.shape[-2:]))
    features = torch.cat([drafter.combine(aux_hidden_states), mask_feature.expand(B, M, -1)], 1)
    positions = torch.cat([torch.arange(R).expand(B, R), anchor + depth], 1)
    bidx = torch.arange(B)[:, None, None]
    gather = blk_index.clamp(min=0)

    def attend(i, attn, x, cos, sin):
        q = attn.project_q(x, cos, sin)
        k, v = attn.project_kv(x, cos, sin)
        real = attn.attend(q[:, :, :R], k[:, :, :R], v[:, :, :R], causal)
        bk = k[:, :, R:].transpose(1, 2)[bidx, gather].permute(0, 3, 1, 2, 4)
        bv = v[:, :, R:].transpose(1, 2)[bidx, gather].permute(0, 3, 1, 2, 4)
        drafts = reference_block_attention(
            attn, q[:, :, R:], k[:, :, :R], v[:, :, :R], ctx_mask, bk, bv, blk_mask
        )
        return torch.cat([real, drafts], 1)

    out, _ = drafter.run_layers(tokens, features, positions, attend)
    return out[:, :R], out[:, R:]


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize(("num_depths", "max_anchors"), [(4, None), (6, 5), (2, 3)])
def test_training_pass_matches_dense_reference(
    verifier, batch, training, num_depths, max_anchors, monkeypatch
):
    """Loss, outputs and every gradient equal the former dense formulation's, with padded
    samples, padding depth rows and sampled (training) or all (validation) depth rows."""
    _, spec, weights = verifier
    torch.manual_seed(0)
    config = Config(num_layers=2, num_depths=num_depths, num_speculative_tokens=num_depths)
    drafter = build(config.model_copy(update={"max_anchors": max_anchors}), spec, weights)
    with torch.no_grad():
        for p in drafter.parameters():  # non-trivial norms and mask_hidden
            p.add_(0.1 * torch.randn_like(p))
    drafter.train(training)
    params = [p for p in drafter.parameters() if p.requires_grad]

    def loss_and_grads():
        torch.manual_seed(11)  # the same sampled depth rows in both passes
        loss, metrics = drafter(batch)
        return loss, metrics, torch.autograd.grad(loss, params, allow_unused=True)

    loss, metrics, grads = loss_and_grads()
    monkeypatch.setattr(drafter, "rows_forward", partial(reference_rows_forward, drafter))
    ref_loss, ref_metrics, ref_grads = loss_and_grads()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert torch.equal(metrics["count"], ref_metrics["count"]) and metrics["count"][1:].sum() > 0
    torch.testing.assert_close(metrics["depth_loss"], ref_metrics["depth_loss"], rtol=1e-5, atol=1e-5)
    for (name, _), g, r in zip(
        [(n, p) for n, p in drafter.named_parameters() if p.requires_grad], grads, ref_grads, strict=True
    ):
        assert (g is None) == (r is None), name
        if g is not None:
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5, msg=name)


# ---------------------------------------------------------------- training forward


def test_forward_backward_counts_and_padding(verifier, batch):
    _, spec, weights = verifier
    torch.manual_seed(0)
    drafter = build(Config(num_layers=2, num_depths=4, num_speculative_tokens=4), spec, weights)
    loss, metrics = drafter(batch)
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert "correct" not in metrics and metrics["count"].shape == (4,)  # KL step: no full argmax
    valid = valid_table(batch, 4)
    n = int(valid[0].sum())
    assert metrics["count"][0] == n  # every depth-0 row is kept
    for d in range(1, 4):  # per sample: floor(n_b * max(r^d, r_min)) at most
        cap = sum(math.floor(int(valid[0, b].sum()) * max(0.7**d, 0.2) + 1e-9) for b in range(3))
        assert 0 < metrics["count"][d] <= cap
    loss.backward()
    grads = {n for n, p in drafter.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert {"mask_hidden", "fc.weight", "lm_head.weight", "layers.1.self_attn.q_proj.weight"} <= grads

    drafter.eval()  # validation: every row whose chain of targets is valid, nothing sampled
    with torch.no_grad():
        a, metrics = drafter(batch)
        junk = pad_tail(batch, row=2, length=16)
        junk["aux_hidden_states"][2, 16:] = -3.0
        b, _ = drafter(junk)
    assert metrics["count"][0] == valid[0].sum()
    for d in range(1, 4):  # depth-d rows exist where the targets of depths 1..d are all valid
        assert metrics["count"][d] == valid[1 : d + 1].all(0).sum()
    torch.testing.assert_close(a, b)  # padding never counts


def test_training_rows_equal_serving_pass(verifier, batch):
    """The depth-d row at anchor t computes what vLLM's parallel-drafting slot d computes."""
    _, spec, weights = verifier
    torch.manual_seed(4)
    drafter = build(
        Config(
            num_layers=2,
            num_depths=5,
            num_speculative_tokens=5,
            norm_before_fc=True,
            norm_before_residual=True,
        ),
        spec,
        weights,
    ).eval()
    ids, aux = batch["input_ids"][:1], batch["aux_hidden_states"][:1, :-1]
    valid = torch.ones(5, 1, ids.shape[1] - 1, dtype=torch.bool)
    anchor, depth, present = drafter.sample_rows(valid, keep_all=True)
    with torch.no_grad():
        out_real, out_depth = drafter.rows_forward(ids, aux, anchor, depth, present)
    for t in (0, 6, 15, 21):
        drafts = greedy_propose(drafter, ids[0, : t + 2], aux[0, : t + 1], 5)
        assert drafts.shape == (5,) and drafts.dtype == torch.long
        where = [((anchor[0] == t) & (depth[0] == d) & present[0]).nonzero()[0, 0] for d in range(1, 5)]
        rows = [out_real[0, t]] + [out_depth[0, m] for m in where]
        trained = torch.stack([drafter.lm_head(r).argmax() for r in rows])
        assert torch.equal(trained, drafts), (t, trained, drafts)


@pytest.mark.parametrize("loss_kind", ["kl", "ce"])
def test_reduced_vocab_and_loss_kinds(verifier, batch, loss_kind):
    _, spec, weights = verifier
    freq = torch.bincount(batch["input_ids"].flatten(), minlength=VOCAB).float()
    d2t, t2d = build_draft_vocab(freq, 40)
    torch.manual_seed(0)
    config = Config(num_layers=1, num_depths=3, num_speculative_tokens=3)
    drafter = build(config, spec, weights, d2t, loss_kind)
    assert drafter.lm_head.weight.shape == (40, HIDDEN)
    loss, _ = drafter(batch)
    loss.backward()
    assert torch.isfinite(loss) and drafter.mask_hidden.grad is not None
    drafter.eval()
    with torch.no_grad():
        _, metrics = drafter(batch)
        valid = valid_table(batch, 3)
        anchor, depth, present = drafter.sample_rows(valid, keep_all=True)
        out_real, out_depth = drafter.rows_forward(
            batch["input_ids"], batch["aux_hidden_states"][:, :-1], anchor, depth, present
        )
        target = verifier_logits(batch["last_hidden_state"], weights.norm, weights.lm_head, spec.rms_norm_eps)
    correct = torch.zeros(3)
    b, t = valid[0].nonzero(as_tuple=True)
    for bi, ti in zip(b.tolist(), t.tolist(), strict=True):
        draft = draft_to_target(drafter.lm_head(out_real[bi, ti]).argmax(), d2t)
        correct[0] += int(draft == target[bi, ti + 1].argmax())
    for bi, m in present.nonzero().tolist():
        d, a = int(depth[bi, m]), int(anchor[bi, m])
        draft = draft_to_target(drafter.lm_head(out_depth[bi, m]).argmax(), d2t)
        correct[d] += int(draft == target[bi, a + 1 + d].argmax())
    assert torch.equal(metrics["correct"], correct)
    drafts = greedy_propose(drafter, batch["input_ids"][0, :9], batch["aux_hidden_states"][0, :8], 3)
    assert t2d[drafts].all()
    assert torch.equal(drafter.export_state()["d2t"], d2t)


def test_config_rules(verifier):
    _, spec, weights = verifier
    with pytest.raises(ValidationError):
        Config(num_depths=4, num_speculative_tokens=5)
    with pytest.raises(ValidationError):
        Config(bogus=1)
    defaults = Config()
    assert (defaults.num_layers, defaults.down_sample_ratio, defaults.down_sample_ratio_min) == (4, 0.7, 0.2)
    with pytest.raises(ValueError, match="mask_token_id"):
        build(Config(), replace(spec, mask_token_id=VOCAB), weights)


# ---------------------------------------------------------------- export


def test_export_config_is_speculators_format(verifier):
    _, spec, weights = verifier
    drafter = build(Config(num_depths=6, num_speculative_tokens=4), spec, weights)
    cfg = drafter.export_config().to_json()
    assert cfg["speculators_model_type"] == "peagle" and cfg["architectures"] == ["PEagleDraftModel"]
    assert cfg["mask_token_id"] == spec.mask_token_id
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 4
    assert cfg["transformer_layer_config"]["vocab_size"] == VOCAB
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    state = drafter.export_state()
    # the speculators library's layout (its PEagleDraftModel refuses [1, n_aux*H]); vLLM views it as [1, -1]
    assert state["mask_hidden"].shape == (1, 1, len(AUX) * HIDDEN)
    assert drafter.mask_hidden.shape == (1, len(AUX) * HIDDEN)  # the training parameter keeps its shape
    assert "layers.0.hidden_norm.weight" in state and "layers.1.hidden_norm.weight" not in state


def test_export_round_trip(verifier, batch):
    _, spec, weights = verifier
    d2t = build_draft_vocab(torch.arange(VOCAB).float(), 120)[0]
    torch.manual_seed(6)
    config = Config(num_layers=2, num_depths=4, num_speculative_tokens=3, max_anchors=7)
    drafter = build(config, spec, weights, d2t, "ce")
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    cfg = drafter.export_config().to_json()
    tensors = drafter.export_state()
    tensors["mask_hidden"] = tensors["mask_hidden"].view(1, 1, -1)  # speculators' own layout
    rebuilt = from_export(cfg, tensors, weights)
    assert rebuilt.config == config and rebuilt.loss_kind == "ce"
    drafter.eval()
    rebuilt.eval()
    with torch.no_grad():
        a, ma = drafter(batch)
        b, mb = rebuilt(batch)
    assert torch.equal(a, b) and torch.equal(ma["correct"], mb["correct"])
    ids, aux = batch["input_ids"][1], batch["aux_hidden_states"][1]
    assert torch.equal(
        greedy_propose(drafter, ids[:11], aux[:10], 3), greedy_propose(rebuilt, ids[:11], aux[:10], 3)
    )
    with pytest.raises(ValueError, match="mask_token_id"):
        from_export({k: v for k, v in cfg.items() if k != "mask_token_id"}, tensors, weights)


@pytest.mark.vllm
def test_export_loads_in_vllm(tmp_path, verifier):
    """vLLM parses the config as parallel drafting and its load_weights fills every used weight."""
    model, spec, weights = verifier
    d2t = build_draft_vocab(torch.arange(VOCAB).float(), 100)[0]
    drafter = build(Config(num_layers=2, num_depths=4, num_speculative_tokens=4), spec, weights, d2t)
    vllm_model, vllm_config, unset = load_into_vllm(
        tmp_path, model, drafter, {"method": "eagle3", "parallel_drafting": True, "num_speculative_tokens": 4}
    )
    assert unset == {"model.embed_tokens.weight", "model.layers.1.hidden_norm.weight"}
    state = drafter.export_state()
    check_vllm_weights(vllm_model, state)
    assert torch.equal(
        vllm_model.mask_hidden, state["mask_hidden"].view(1, -1)
    )  # vLLM views [1, 1, n] as [1, n]
    hf = vllm_config.speculative_config.draft_model_config.hf_config
    assert hf.pard_token == spec.mask_token_id and hf.norm_before_residual is False

    from vllm.transformers_utils.configs.speculators import SpeculatorsConfig

    assert SpeculatorsConfig.extract_vllm_speculative_config(drafter.export_config().to_json()) == {
        "method": "eagle3",
        "parallel_drafting": True,
        "num_speculative_tokens": 4,
    }


# ---------------------------------------------------------------- learning


def test_overfits_a_real_verifier(verifier):
    model, spec, weights = verifier
    data = greedy_dataset(model, num=8, prompt_len=4, new_tokens=28)
    data = pad_tail(data, row=7, length=24)
    torch.manual_seed(0)
    drafter = build(Config(num_layers=2, num_depths=4, num_speculative_tokens=4), spec, weights)
    steps, acc = overfit(drafter, data, max_steps=500, lr=1e-2)
    assert (acc > 0.9).all(), (steps, acc)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serves_what_propose_drafts(tmp_path):
    """Trained, exported, served by vLLM (eagle3 + parallel_drafting): same acceptance as propose()."""
    pytest.importorskip("vllm")
    model, spec, weights = tiny_verifier(hidden=128)  # vLLM's CPU attention needs head_dim >= 32
    data = greedy_dataset(model, num=8, prompt_len=4, new_tokens=28 + 6, seed=7)
    train = {k: v[:, : 4 + 28] for k, v in data.items()}
    torch.manual_seed(0)
    drafter = build(Config(num_layers=2, num_depths=4, num_speculative_tokens=4), spec, weights)
    overfit(drafter, train, max_steps=600, lr=1e-2)
    drafter.eval()
    accepted, drafts = embedded_acceptance(drafter, data, prompt_len=4, end=4 + 28, k=4)
    assert sum(accepted) / drafts > 2.0
    served = vllm_acceptance(
        tmp_path,
        model,
        drafter,
        data["input_ids"][:, :4].tolist(),
        28,
        {"method": "eagle3", "parallel_drafting": True, "num_speculative_tokens": 4},
    )
    assert served["outputs"] == data["input_ids"][:, 4 : 4 + 28].tolist()
    m = served["metrics"]
    assert abs(m["vllm:spec_decode_num_drafts"] - drafts) <= 2
    for ours, theirs in zip(accepted, m["vllm:spec_decode_num_accepted_tokens_per_pos"], strict=True):
        assert abs(ours - theirs) <= 3, (accepted, m)
