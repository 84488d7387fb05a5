"""The published configs of the verifiers the shipped GPU recipes name, as transformers configs.

`specctl plan` must size a job for meta-llama/Llama-3.3-70B-Instruct on a laptop with no hub
access, and `make rehearse` builds random-weight models of the real width from them. The fields
are copied from each model's config.json on the hub (the ones that set shapes and numerics); a
verifier not listed here is read from its own config (a local directory, the built-in alias, or the
hub cache).
"""

from __future__ import annotations

from typing import Any

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

_LLAMA_31_8B: dict[str, Any] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": _LLAMA3_ROPE,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}

PUBLISHED: dict[str, dict[str, Any]] = {
    "meta-llama/Llama-3.1-8B-Instruct": _LLAMA_31_8B,
    # Llama-3.3-70B-Instruct: the same family, wider and deeper
    "meta-llama/Llama-3.3-70B-Instruct": {
        **_LLAMA_31_8B,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
    },
    "Qwen/Qwen3-8B": {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
}


def published_config(name: str, **overrides: Any) -> Any | None:
    """The transformers config of a listed hub id (with `overrides`, e.g. fewer layers), else None."""
    fields = PUBLISHED.get(name)
    if fields is None:
        return None
    from transformers import AutoConfig

    fields = {**fields, **overrides}
    return AutoConfig.for_model(fields.pop("model_type"), **fields)
