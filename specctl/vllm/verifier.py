"""The verifier as vLLM loads it: where from, its tokenizer, config and stop ids -- no weights here.

vLLM loads the weights in its own process (a worker or a server); specctl only needs what to
point it at and what the prompts and the stop ids are. Every vLLM-backed command reads the
verifier this one way: collect (specctl.vllm.collect wraps it in the collect stage's backend) and
both vLLM backends of bench.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specctl.recipe import VerifierSection


@dataclass(frozen=True)
class VllmVerifier:
    """A verifier reference vLLM can load, with what specctl reads of it."""

    section: VerifierSection
    source: str  # what vLLM loads: a local directory or a hub id
    hub_id: str | None  # recorded in exported drafters so vLLM finds the verifier
    tokenizer: Any
    config: Any  # the verifier's HF (text) config
    stop_token_ids: tuple[int, ...]  # the ids that end a turn (data.engines.stop_token_ids)

    @property
    def name_or_path(self) -> str:
        return self.section.name_or_path

    @property
    def local_path(self) -> str | None:
        """A directory vLLM / transformers can open offline (None: a hub id)."""
        return self.source if Path(self.source).is_dir() else None

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def max_positions(self) -> int | None:
        """The verifier's context limit (max_position_embeddings), None if its config has none."""
        return getattr(self.config, "max_position_embeddings", None)


def load_vllm_verifier(verifier: VerifierSection | str | Path) -> VllmVerifier:
    """Tokenizer, text config and stop ids of the recipe's verifier (or a path / hub id): seconds,
    no weights; a verifier that cannot be read is one VerifierError line."""
    from specctl.data.engines import checkpoint_stop_ids
    from specctl.verifier import locate_verifier, read_tokenizer_and_config

    section = (
        verifier if isinstance(verifier, VerifierSection) else VerifierSection(name_or_path=str(verifier))
    )
    source, hub_id = locate_verifier(section.name_or_path, section.revision)
    tokenizer, config = read_tokenizer_and_config(section, source)
    stop_ids = checkpoint_stop_ids(tokenizer, source, section.revision)
    return VllmVerifier(section, source, hub_id, tokenizer, config.get_text_config(), tuple(stop_ids))
