"""Named tensors of an HF checkpoint, read from its safetensors files without building the model.

Offline training borrows three of the verifier's tensors (token embeddings, final norm, LM head)
and the vLLM collect backend two of them. Building the causal LM for them costs the whole model
on every rank: 16 GB at 8B, 140 GB at 70B, more than a GPU holds. A safetensors file is indexed
by name, so each tensor is read by itself, straight onto the device it is used on.

Names are the ones HF saves causal LMs with: `<prefix>embed_tokens.weight`, `<prefix>norm.weight`
beside it (Llama / Qwen3: prefix `model.`) and `lm_head.weight`; a checkpoint that ties the LM head
to the embeddings (config.tie_word_embeddings) uses the embeddings, as transformers does.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from specctl.drafters.api import VerifierWeights
from specctl.errors import VerifierError

INDEX_FILE = "model.safetensors.index.json"


def tensor_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it; empty when the checkpoint has none (.bin only).

    A sharded checkpoint's files are the ones its index names (a hub snapshot may hold only the
    shards that were downloaded; a repository may also hold the same weights in another format's
    file); the names come from each file's header, which is what a read can find.
    """
    index = model_dir / INDEX_FILE
    if index.is_file():
        named = set(json.loads(index.read_text())["weight_map"].values())
        files = sorted(f for f in (model_dir / name for name in named) if f.is_file())
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    where: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            where.update(dict.fromkeys(f.keys(), file))
    return where


@dataclass(frozen=True)
class HeadNames:
    """Where a causal LM checkpoint keeps the tensors drafters borrow."""

    embed: str
    norm: str
    lm_head: str  # == embed when the checkpoint ties them

    def all(self) -> list[str]:
        return list(dict.fromkeys((self.embed, self.norm, self.lm_head)))


def head_names(names: Iterable[str], tied: bool) -> HeadNames | None:
    """The borrowed tensors' names among a checkpoint's `names`, None when one is missing.

    The embeddings with the shortest prefix are the decoder's (a multimodal checkpoint may hold
    others); the final norm sits beside them.
    """
    names = set(names)
    embeds = sorted((n for n in names if n.endswith("embed_tokens.weight")), key=lambda n: (len(n), n))
    if not embeds:
        return None
    embed = embeds[0]
    norm = embed.removesuffix("embed_tokens.weight") + "norm.weight"
    lm_head = embed if tied else next((n for n in sorted(names) if n.endswith("lm_head.weight")), None)
    if norm not in names or lm_head is None:
        return None
    return HeadNames(embed, norm, lm_head)


def tied_embeddings(config: Any) -> bool:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "tie_word_embeddings", False))


def read_tensors(
    files: dict[str, Path], names: list[str], device: torch.device | str, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """The named tensors, each read alone from its file onto `device`, floats cast to `dtype`."""
    out: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    for file, group in by_file.items():
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for name in group:
                t = f.get_tensor(name)
                out[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


def read_head(
    model_dir: Path,
    config: Any,
    device: torch.device | str,
    dtype: torch.dtype | None,
    hint: str,
    files: dict[str, Path] | None = None,
) -> VerifierWeights:
    """Embeddings [V, H], LM head [V, H] (the same tensor when tied) and final norm [H] of the
    checkpoint in `model_dir`, on `device` in `dtype` (None: as stored); `hint` says what to do
    when they are missing or do not fit the config."""
    files = tensor_files(model_dir) if files is None else files
    names = head_names(files, tied_embeddings(config))
    if names is None:
        raise VerifierError(f"{model_dir}: found no final norm / LM head in its safetensors files; {hint}")
    t = read_tensors(files, names.all(), device, dtype)
    weights = VerifierWeights(embed_tokens=t[names.embed], lm_head=t[names.lm_head], norm=t[names.norm])
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    H, V = text.hidden_size, text.vocab_size
    fits = weights.norm.shape == (H,) and all(
        w.ndim == 2 and w.shape[1] == H and w.shape[0] == V for w in (weights.embed_tokens, weights.lm_head)
    )
    if not fits:
        shapes = {n: list(t[n].shape) for n in names.all()}
        raise VerifierError(
            f"{model_dir}: {shapes} do not fit hidden size {H} / vocabulary {V} in config.json; {hint}"
        )
    return weights
