"""The `FeatureOrigin` a recipe's verifier and data give: what collect records in a feature store,
and what train checks the store against (specctl/origin.py says what is compared and why).

Both sides compute it the same way from what they have loaded: collect from the verifier it ran
and the data manifest it wrote, train from the verifier it borrows tensors from and the recipe's
data settings (`data_fingerprint`: the same hash the data manifest records), so a store copied
into another run, a verifier swapped for a fine-tune or a data file edited since is caught
before a step is taken.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specctl.data.prepare import data_fingerprint, tokenizer_fingerprint
from specctl.features import FeatureStore, Layout
from specctl.origin import (
    FeatureOrigin,
    cached_model_dir,
    check_origin,
    snapshot_revision,
    weight_fingerprints,
)
from specctl.progress import note
from specctl.recipe import Recipe
from specctl.verifier import check_aux_layer_ids, config_hash, default_aux_layer_ids


def feature_origin(
    recipe: Recipe, verifier: Any, aux_ids: tuple[int, ...] | list[int], layout: Layout, data_hash: str
) -> FeatureOrigin:
    """The origin of features of `recipe` from `verifier` (any loaded form: HF, vLLM, its files, its
    borrowed tensors) over data whose fingerprint is `data_hash`."""
    section = recipe.verifier
    model_dir = cached_model_dir(getattr(verifier, "local_path", None), verifier.hub_id, section.revision)
    index, weights = weight_fingerprints(model_dir)
    return FeatureOrigin(
        verifier=verifier.hub_id or verifier.name_or_path,
        hub_id=verifier.hub_id,
        revision=snapshot_revision(model_dir, section.revision),
        weights_index=index,
        weights=weights,
        tokenizer=tokenizer_fingerprint(verifier.tokenizer),
        data=data_hash,
        config=config_hash(verifier.config),
        hidden_size=verifier.config.hidden_size,
        num_layers=verifier.config.num_hidden_layers,
        aux_layer_ids=tuple(aux_ids),
        features=layout.settings(),
    )


def check_store_origin(
    path: Path, store: FeatureStore, recipe: Recipe, verifier: Any
) -> FeatureOrigin | None:
    """The store's origin, refused (one line naming the field) when the recipe's verifier and data
    give another; None, with a one-line warning, for a store collected before origins existed."""
    have = store.manifest.origin
    if have is None:
        note(
            f"warning: {path} records no origin (collected before specctl recorded one): its verifier "
            "weights, tokenizer and data are not checked; rerun collect-hidden-states to have them checked"
        )
        return None
    L = verifier.config.num_hidden_layers
    aux_ids = check_aux_layer_ids(recipe.features.aux_layer_ids or default_aux_layer_ids(L), L)
    data_hash = data_fingerprint(recipe.data, verifier.tokenizer)
    want = feature_origin(recipe, verifier, aux_ids, Layout.from_section(recipe.features), data_hash)
    check_origin(path, have, want)
    return have
