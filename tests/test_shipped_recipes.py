"""Every shipped recipe builds its drafter, at full size, on the meta device (no download).

The verifiers' configs are written here from their published config.json values, so the
8-GPU recipes (Llama-3.1-8B-Instruct, Qwen3-8B, Llama-3.3-70B-Instruct) are checked on a CPU with
no hub access:
the recipe validates, its aux layers and mask token fit the verifier, the drafter config
is the published one for its algorithm, and the module builds with the expected size.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, Qwen3Config

from specctl.drafters import DRAFTERS
from specctl.drafters.api import VerifierWeights
from specctl.recipe import load_recipe
from specctl.verifier import check_aux_layer_ids, default_aux_layer_ids, spec_from_config

RECIPES = Path(__file__).resolve().parents[1] / "specctl" / "recipes"

# Published config.json values (hub: meta-llama/Llama-3.1-8B-Instruct, Qwen/Qwen3-8B,
# meta-llama/Llama-3.3-70B-Instruct, HuggingFaceTB/SmolLM2-135M-Instruct), and the size of each
# tokenizer.
VERIFIERS = {
    "meta-llama/Llama-3.1-8B-Instruct": (
        LlamaConfig(
            architectures=["LlamaForCausalLM"],
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            max_position_embeddings=131072,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
        128256,
    ),
    "meta-llama/Llama-3.3-70B-Instruct": (
        LlamaConfig(
            architectures=["LlamaForCausalLM"],
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            vocab_size=128256,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            max_position_embeddings=131072,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
        128256,
    ),
    "Qwen/Qwen3-8B": (
        Qwen3Config(
            architectures=["Qwen3ForCausalLM"],
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            max_position_embeddings=40960,
            tie_word_embeddings=False,
        ),
        151669,
    ),
    "smollm2-135m-instruct": (
        LlamaConfig(
            architectures=["LlamaForCausalLM"],
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=49152,
            rms_norm_eps=1e-5,
            rope_theta=100000.0,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
        ),
        49152,
    ),
}


SHIPPED = sorted(p.name for p in RECIPES.glob("*.yaml"))


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter a module registers lives on the meta device (no memory, no init);
    buffers and index tables stay real, as the drafter computes them from the d2t table."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _mask_token_id(recipe, tokenizer_size: int, vocab: int) -> int:
    """What `resolve_mask_token_id` picks without a tokenizer file: the recipe's id, else the
    first embedding row past the tokenizer (the padded vocabulary of Qwen3)."""
    if recipe.drafter.mask_token_id is not None:
        return recipe.drafter.mask_token_id
    assert tokenizer_size < vocab, "no mask token and no spare row: the recipe must set drafter.mask_token_id"
    return tokenizer_size


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipe_builds_its_drafter_on_the_meta_device(name):
    recipe = load_recipe(RECIPES / name)
    config, tokenizer_size = VERIFIERS[recipe.verifier.name_or_path]
    L = config.num_hidden_layers
    aux = check_aux_layer_ids(recipe.features.aux_layer_ids or default_aux_layer_ids(L), L)
    mask = _mask_token_id(recipe, tokenizer_size, config.vocab_size)
    assert 0 <= mask < config.vocab_size
    spec = spec_from_config(config, recipe.verifier.name_or_path, aux, mask)
    algos = [recipe.drafter.algo] if recipe.drafter.algo else list(DRAFTERS)
    for algo in algos:
        drafter_config = getattr(recipe.drafter, algo)
        published = DRAFTERS[algo].published  # the published shape (docs/algorithms.md), from its spec
        eight_gpu = not recipe.verifier.name_or_path.startswith("smollm2")
        if eight_gpu and published is not None:
            assert published(drafter_config), (name, algo, drafter_config)
        draft_vocab = recipe.drafter.draft_vocab_size
        if draft_vocab is not None:
            assert draft_vocab <= config.vocab_size
        d2t = (
            None if draft_vocab is None else torch.zeros(draft_vocab, dtype=torch.long)
        )  # draft id i = token i
        V, H = config.vocab_size, config.hidden_size
        meta = dict(device="meta")
        weights = VerifierWeights(
            torch.empty(V, H, **meta), torch.empty(V, H, **meta), torch.empty(H, **meta)
        )
        with parameters_on_meta():
            drafter = DRAFTERS[algo].build(drafter_config, spec, weights, d2t, recipe.train.loss)
        params = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
        layer = 4 * H * H + 3 * H * config.intermediate_size  # order of one decoder layer, as a sanity scale
        assert 0.5 * layer < params < 12 * layer + 2 * V * H, (name, algo, params)
        assert all(p.device.type == "meta" for p in drafter.parameters())  # nothing was allocated


def test_every_algorithm_has_a_recipe_for_each_8b_verifier():
    algos = {
        (load_recipe(RECIPES / n).verifier.name_or_path, load_recipe(RECIPES / n).drafter.algo)
        for n in SHIPPED
    }
    for verifier in ("meta-llama/Llama-3.1-8B-Instruct", "Qwen/Qwen3-8B"):
        assert {a for v, a in algos if v == verifier} >= set(DRAFTERS), verifier


# One 8-GPU node's local disk: 8 TB, the smallest size common on such nodes (AWS p4d.24xlarge:
# 8 x 1 TB NVMe; DGX H100 and AWS p5: ~30 TB). The store may take 80% of it: the rest is for the
# data directory, the generation journal, the hub cache (16 GB per 8B model) and checkpoints.
NODE_DISK_BYTES = 8 * 10**12
STORE_SHARE = 0.8


CPU_RECIPES = {"results.yaml", "demo.yaml"}  # the SmolLM2 runs of `make results` and `make demo`


@pytest.mark.parametrize(
    "name", [n for n in SHIPPED if not n.startswith("quickstart") and n not in CPU_RECIPES]
)
def test_8b_recipe_feature_store_fits_one_node_even_at_max_length(name, monkeypatch):
    """Runnable as shipped: collect's disk estimate for the 8-GPU recipes (8B and 70B verifiers)
    passes on one node's disk even if every conversation grew to data.max_length (and refuses on a
    quarter of it)."""
    import specctl.estimate as estimate
    from specctl.estimate import DiskSpaceError, StoreEstimate, check_store_fits
    from specctl.features import Layout, layout_bytes_per_token

    recipe = load_recipe(RECIPES / name)
    config, _ = VERIFIERS[recipe.verifier.name_or_path]
    L = config.num_hidden_layers
    aux = check_aux_layer_ids(recipe.features.aux_layer_ids or default_aux_layer_ids(L), L)
    layout = Layout.from_section(recipe.features)
    bytes_per_token = layout_bytes_per_token(layout, config.hidden_size, len(aux), config.vocab_size)
    assert recipe.train.mode == "offline" and layout.aux_dtype == "fp8" and layout.target == "topk"
    tokens = recipe.data.max_samples * recipe.data.max_length
    assert tokens * bytes_per_token <= STORE_SHARE * NODE_DISK_BYTES, (name, tokens * bytes_per_token)
    plan = StoreEstimate(Path("runs"), recipe.data.max_samples, tokens, bytes_per_token, layout, exact=False)
    monkeypatch.setattr(estimate, "free_bytes", lambda path: NODE_DISK_BYTES)
    check_store_fits(plan, force=False)
    monkeypatch.setattr(estimate, "free_bytes", lambda path: NODE_DISK_BYTES // 4)
    bound = {4096: "5.08", 8192: "6.07"}[config.hidden_size]  # TB: the recipes' comments say why
    with pytest.raises(DiskSpaceError, match=f"needs ~{bound} TB more"):
        check_store_fits(plan, force=False)
    # generation grows no conversation past max_length, and the answers fit in it
    assert recipe.data.regenerate and recipe.data.max_new_tokens < recipe.data.max_length


# Published parameter count of Llama-3.3-70B-Instruct (its safetensors index: 141,107,412,992 bytes
# in bf16) and the memory of the 80 GB GPUs the 70B recipe is written for.
LLAMA_70B_PARAMS = 70_553_706_496
GPU_BYTES = 80 * 10**9


def _llama_params(c) -> int:
    """Parameters of a Llama config, counted from its shapes (embeddings and LM head untied)."""
    H, inner, L, V = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size
    kv = c.num_key_value_heads * (H // c.num_attention_heads)
    layer = H * H + 2 * H * kv + H * H + 3 * H * inner + 2 * H  # q, k, v, o, MLP, two norms
    return 2 * V * H + L * layer + H


def test_70b_recipe_spans_enough_gpus_for_its_weights_and_engines():
    """The 70B recipe's tensor_parallel_size holds the bf16 weights with room left on 80 GB GPUs,
    and one node's 8 GPUs run whole engines of it (the numbers its comments give)."""
    from specctl.data.engines import worker_devices

    recipe = load_recipe(RECIPES / "dflash-llama-70b.yaml")
    config, _ = VERIFIERS[recipe.verifier.name_or_path]
    assert _llama_params(config) == LLAMA_70B_PARAMS
    tp = recipe.verifier.tensor_parallel_size
    per_gpu = 2 * LLAMA_70B_PARAMS / tp  # bf16 weights on each GPU of an engine
    assert per_gpu < 0.5 * GPU_BYTES  # 35.3 GB: the rest of vLLM's 90% is KV cache
    assert 2 * LLAMA_70B_PARAMS / (tp // 2) > 0.85 * GPU_BYTES  # half the GPUs would leave no KV cache
    assert recipe.verifier.dtype == "bfloat16" and 8 % tp == 0
    assert worker_devices([str(i) for i in range(8)], tp) == ["0,1,2,3", "4,5,6,7"]
    assert recipe.features.aux_layer_ids == list(default_aux_layer_ids(config.num_hidden_layers))
    assert recipe.train.parallelism == "fsdp"  # 4.48B trainable parameters: AdamW state past one GPU
