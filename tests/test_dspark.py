"""DSpark drafter: Markov head, confidence head, anchor-as-first-prediction layout, export."""

import pytest
import torch
import torch.nn.functional as F
from test_dflash import (
    HIDDEN,
    MASK_ID,
    VOCAB,
    assert_matches_reference,
    build,
    expected_vllm_names,
    greedy_dataset,
    mean_accepted,
    overfit,
    perturbed,
    random_batch,
    tiny_weights,
    vllm_source,
)

from specctl.drafters import DRAFTERS
from specctl.drafters.api import greedy_propose
from specctl.drafters.dflash import block_queries
from specctl.drafters.dspark import Config, DSparkDrafter, confident_prefix_length, total_variation
from specctl.drafters.targets import build_draft_vocab, targets_from_logits

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def dspark(**config) -> DSparkDrafter:
    return build("dspark", **{"markov_rank": 8, **config})


def test_config_defaults_are_the_published_recipe():
    c = Config()
    assert (c.num_layers, c.block_size, c.max_anchors, c.gamma) == (5, 7, 512, 4.0)
    assert c.sample_from_anchor is True and c.predictions_per_block == 7
    assert (c.markov_rank, c.markov_head_type) == (256, "vanilla")
    assert c.enable_confidence_head and c.confidence_head_with_markov
    assert (c.token_loss_weight, c.l1_loss_weight, c.confidence_loss_weight) == (0.1, 0.9, 1.0)
    for name, field in Config.model_fields.items():
        assert field.description, f"{name} has no description"
    with pytest.raises(ValueError):
        Config(markov_head_type="gated")
    assert Config(sample_from_anchor=False).predictions_per_block == 6


def test_registered():
    spec = DRAFTERS["dspark"]
    assert spec.speculators_model_type == "dspark" and spec.architectures == ("DSparkDraftModel",)
    assert spec.config_cls is Config


def test_markov_bias_depends_on_the_previous_token():
    m = dspark()
    hidden = torch.randn(5, HIDDEN)
    base = m.draft_logits(hidden)
    a, _ = m.block_logits(hidden, torch.full((5,), 3))
    b, _ = m.block_logits(hidden, torch.full((5,), 4))
    assert not torch.allclose(a, b)
    w1, w2 = m.markov_head.markov_w1.weight, m.markov_head.markov_w2.weight
    torch.testing.assert_close(a, base + w1[3] @ w2.T)


def test_block_is_sampled_left_to_right():
    """A Markov head that maps token t to t+1 (and a flat backbone) chains the whole block:
    each draft is conditioned on the previous draft, starting from the anchor."""
    m = dspark(markov_rank=VOCAB, num_layers=1).eval()
    with torch.no_grad():
        m.norm.weight.zero_()  # backbone logits are all 0
        m.markov_head.markov_w1.weight.copy_(torch.eye(VOCAB) * 10)
        m.markov_head.markov_w2.weight.copy_(torch.roll(torch.eye(VOCAB), 1, 0))  # bias[t+1] = 10 after t
    batch = random_batch(B=1, T=12)
    ids = batch["input_ids"][0, :9].clone()
    ids[-1] = 40
    drafts, confidence = m.propose_with_confidence(ids, batch["aux_hidden_states"][0, :8], 4)
    assert drafts.tolist() == [41, 42, 43, 44]
    assert confidence.shape == (4,) and ((confidence > 0) & (confidence < 1)).all()


def test_propose_matches_a_manual_sequential_loop():
    m = dspark().eval()
    batch = random_batch(B=1, T=16)
    N, K = 10, 4
    ids, aux = batch["input_ids"][0, : N + 1], batch["aux_hidden_states"][0, :N]
    with torch.no_grad():
        qids, pos = block_queries(ids[None], torch.tensor([[N]]), K, MASK_ID)  # anchor predicts: K slots
        hidden = m.run_blocks(qids, pos, m.context_kv(aux[None]), None)[0, 0]
        prev, want, conf = ids[-1:], [], []
        for i in range(K):
            logits, emb = m.block_logits(hidden[i : i + 1], prev)
            prev = logits.argmax(-1)
            want.append(int(prev))
            conf.append(torch.sigmoid(m.confidence_head(hidden[i : i + 1], emb)))
    drafts, confidence = m.propose_with_confidence(ids, aux, K)
    assert drafts.tolist() == want and torch.equal(greedy_propose(m, ids, aux, K), drafts)
    torch.testing.assert_close(confidence, torch.cat(conf))


def test_training_layout_is_anchor_as_first_prediction():
    """With sample_from_anchor the anchor's own output is prediction 1 (token anchor+1)."""
    m = dspark().eval()
    batch = random_batch(B=1, T=14)
    batch["loss_mask"][:] = True
    rows = m.gather_rows(batch)
    assert rows.num_predictions == 4 == m.config.block_size
    first = rows.position == 0
    # prediction 1 of the block anchored at a is conditioned on the anchor token itself
    anchors = torch.arange(1, 13)
    assert rows.prev_ids[first].tolist() == batch["input_ids"][0, anchors].tolist()
    N = 5
    ids, aux = batch["input_ids"][0, : N + 1], batch["aux_hidden_states"][0, :N]
    hidden = m.propose_hidden(ids, aux, 4)
    k_rows = (rows.prev_ids == batch["input_ids"][0, N]) & first
    assert any(torch.allclose(hidden[0], h, atol=1e-5) for h in rows.hidden[k_rows])


@pytest.mark.parametrize(
    ("T", "block_size", "max_anchors", "config"),
    [
        (24, 4, 512, {}),
        (30, 5, 6, {"confidence_head_with_markov": False}),
        (17, 3, 3, {"sample_from_anchor": False}),
    ],
)
def test_training_pass_matches_per_anchor_reference(T, block_size, max_anchors, config):
    """DSpark's loss (token + L1 + confidence BCE) and gradients through the shared-context
    block pass equal the former per-anchor pass (test_dflash's reference)."""
    # the reference weighs positions by the fixed exp decay; D-PACE has its own reference test
    m = perturbed(dspark(block_size=block_size, max_anchors=max_anchors, position_weights="exp", **config))
    batch = random_batch(B=3, T=T, seed=T)
    batch["loss_mask"][-1] = False
    batch["loss_mask"][-1, 5:7] = True  # two candidates only: the other anchor slots are invalid
    assert_matches_reference(m, batch)


def test_total_variation_brute_force():
    g = torch.Generator().manual_seed(0)
    target = torch.randn(6, VOCAB, generator=g) * 3
    draft = torch.randn(6, VOCAB, generator=g) * 3
    p, q = F.softmax(target, -1), F.softmax(draft, -1)
    full = targets_from_logits(target, None)
    torch.testing.assert_close(total_variation(draft, full), 0.5 * (p - q).abs().sum(-1))
    torch.testing.assert_close(total_variation(target, full), torch.zeros(6), atol=1e-6, rtol=0)
    _, t2d = build_draft_vocab(torch.rand(VOCAB, generator=g), 50)
    draft_small = torch.randn(6, 50, generator=g)
    q_full = torch.zeros(6, VOCAB)
    q_full[:, t2d] = F.softmax(draft_small, -1)  # draft mass only on kept ids
    want = 0.5 * (p - q_full).abs().sum(-1)
    torch.testing.assert_close(total_variation(draft_small, targets_from_logits(target, t2d)), want)
    # 1 - TV is the acceptance probability of a sampled draft token: sum of min(p, q)
    torch.testing.assert_close(1 - want, torch.minimum(p, q_full).sum(-1))


def test_confidence_is_trained_toward_one_minus_tv():
    m = dspark(token_loss_weight=0.0, l1_loss_weight=0.0).eval()
    batch = random_batch()
    rows = m.gather_rows(batch)
    loss, metrics = m.rows_loss(rows)
    logits, emb = m.block_logits(rows.hidden, rows.prev_ids)
    target = 1 - total_variation(logits, rows.target)
    conf_logit = m.confidence_head(rows.hidden, emb)
    torch.testing.assert_close(loss, F.binary_cross_entropy_with_logits(conf_logit, target.detach()))
    assert metrics["accept_prob"].sum() == pytest.approx(float(target.detach().sum()), rel=1e-5)
    assert metrics["confidence"].sum() == pytest.approx(
        float(torch.sigmoid(conf_logit).detach().sum()), rel=1e-5
    )
    loss.backward()
    assert m.confidence_head.proj.weight.grad.abs().sum() > 0
    assert m.markov_head.markov_w2.weight.grad is None or m.markov_head.markov_w2.weight.grad.abs().sum() == 0


def test_confident_prefix_length():
    c = torch.tensor([0.9, 0.9, 0.5, 0.99])
    assert confident_prefix_length(c, 0.0) == 4
    assert confident_prefix_length(c, 0.8) == 2  # survival 0.9, 0.81, 0.405, ...
    assert confident_prefix_length(c, 0.95) == 0


@pytest.mark.parametrize("loss", ["kl", "ce"])
def test_forward_backward(loss):
    m = dspark(loss=loss)
    out, metrics = m(random_batch())
    assert out.ndim == 0 and torch.isfinite(out)
    out.backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert set(metrics) >= {"loss", "correct", "count", "accept_prob", "confidence"}
    assert metrics["count"].shape == (4,)
    assert ((metrics["accept_prob"] >= 0) & (metrics["accept_prob"] <= metrics["count"])).all()


def test_without_confidence_head():
    m = dspark(enable_confidence_head=False)
    out, metrics = m(random_batch())
    out.backward()
    assert "confidence" not in metrics and not any("confidence" in n for n in m.export_state())
    batch = random_batch()
    drafts, confidence = m.propose_with_confidence(
        batch["input_ids"][0, :9], batch["aux_hidden_states"][0, :8], 3
    )
    assert confidence is None and drafts.shape == (3,)


@pytest.mark.parametrize("reduced", [False, True])
def test_exported_names_are_what_vllm_loads(reduced):
    d2t = build_draft_vocab(torch.arange(VOCAB).float(), 100)[0] if reduced else None
    m = dspark(d2t=d2t, num_layers=3, confidence_head_with_markov=not reduced)
    state = m.export_state()
    # vllm 0.32 qwen3_dspark.py: DSparkMarkovHead.markov_w1 (Embedding(vocab, r)) / markov_w2
    # (LMHead(draft vocab, r)), DSparkConfidenceHead.proj (Linear(H [+ r], 1, bias=True))
    heads = {
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "confidence_head.proj.weight",
        "confidence_head.proj.bias",
    }
    assert set(state) == expected_vllm_names(3, reduced) | heads
    vd = 100 if reduced else VOCAB
    assert state["markov_head.markov_w1.weight"].shape == (VOCAB, 8)
    assert state["markov_head.markov_w2.weight"].shape == (vd, 8)
    assert state["confidence_head.proj.weight"].shape == (1, HIDDEN + (0 if reduced else 8))
    source = vllm_source("qwen3_dspark.py")
    if source is not None:
        for attr in (
            "self.markov_w1 =",
            "self.markov_w2 =",
            "self.proj =",
            "self.markov_head =",
            "self.confidence_head",
            '"t2d" in name',
            '"d2t" in name',
            "bias=True",
        ):
            assert attr in source, attr


def test_export_config():
    c = dspark(block_size=5).export_config().to_json()
    assert c["speculators_model_type"] == "dspark" and c["architectures"] == ["DSparkDraftModel"]
    assert c["sample_from_anchor"] is True and c["block_size"] == 5
    assert c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert (c["markov_rank"], c["markov_head_type"]) == (8, "vanilla")
    assert c["enable_confidence_head"] is True and c["confidence_head_with_markov"] is True
    assert c["mask_token_id"] == MASK_ID and c["aux_hidden_state_layer_ids"] == [1, 2, 3]


@pytest.mark.vllm
def test_vllm_parses_the_exported_config():
    base = pytest.importorskip("vllm.transformers_utils.configs.speculators.base")
    c = dspark(block_size=5).export_config().to_json()
    pre = base.SpeculatorsConfig.extract_transformers_pre_trained_config(dict(c))
    assert pre["architectures"] == ["Qwen3DSparkModel"]  # vLLM maps the speculators name to its loader
    assert pre["target_layer_ids"] == [0, 1, 2] and pre["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert pre["sample_from_anchor"] is True and pre["dspark_bonus_anchor"] is False
    assert (pre["markov_rank"], pre["block_size"], pre["mask_token_id"]) == (8, 5, MASK_ID)
    assert pre["enable_confidence_head"] is True and pre["confidence_head_with_markov"] is True
    spec = base.SpeculatorsConfig.extract_vllm_speculative_config(c)
    assert spec == {"method": "dspark", "num_speculative_tokens": 5}


@pytest.mark.parametrize("reduced", [False, True])
def test_export_round_trip(reduced):
    d2t = build_draft_vocab(torch.arange(VOCAB).float(), 100)[0] if reduced else None
    m = dspark(d2t=d2t).eval()
    config_json = m.export_config().to_json()
    r = (
        DRAFTERS["dspark"]
        .from_export(DRAFTERS["dspark"].format_cls.from_json(config_json), m.export_state(), tiny_weights())
        .eval()
    )
    assert type(r) is DSparkDrafter and r.config == m.config
    batch = random_batch()
    torch.testing.assert_close(r(batch)[0], m(batch)[0], rtol=0, atol=0)
    args = (batch["input_ids"][0, :15], batch["aux_hidden_states"][0, :14], 4)
    d1, c1 = m.propose_with_confidence(*args)
    d2, c2 = r.propose_with_confidence(*args)
    assert torch.equal(d1, d2) and torch.equal(c1, c2)
    foreign = {k: v for k, v in config_json.items() if k != "specctl"}
    f = (
        DRAFTERS["dspark"]
        .from_export(DRAFTERS["dspark"].format_cls.from_json(foreign), m.export_state(), tiny_weights())
        .eval()
    )
    assert f.config.markov_rank == 8 and f.config.block_size == m.config.block_size
    assert torch.equal(greedy_propose(f, *args), d1)


@pytest.fixture(scope="module")
def greedy_data():
    return greedy_dataset()


def test_overfits_features_of_a_real_model(greedy_data):
    batch, spec, weights = greedy_data
    torch.manual_seed(0)
    m = DRAFTERS["dspark"].build(
        Config(num_layers=1, block_size=3, markov_rank=16), spec, weights, None, "kl"
    )
    acc = overfit(m, batch)
    assert min(acc) > 0.9, acc
    # left-to-right proposal with its own drafts as previous tokens
    assert mean_accepted(m, batch, 3) > 1.8
