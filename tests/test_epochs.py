"""`specctl train --lr / --max-steps / --epochs`: aliases of the recipe's train fields, and an epoch
of the feature store converted to the steps the loop takes to visit every training sample once."""

from __future__ import annotations

import random

import pytest
import yaml
from test_cli import run_main
from test_train import collected_recipe

from specctl.checkpoint import latest_checkpoint, saved_recipe
from specctl.recipe import dump_recipe
from specctl.train.epochs import epoch_steps, steps_per_epoch
from specctl.train.loader import micro_batch_at
from specctl.train.loop import split_indices


def brute_force_steps(lengths: list[int], train_ids: list[int], budget: int, micro: int, seed: int) -> int:
    """Walk the loop's own stream of micro-batches (specctl.train.loader.micro_batch_at), `micro` a step,
    until every training sample has been in a batch: the steps one epoch takes."""
    from specctl.batching import length_buckets

    buckets = length_buckets(lengths, budget, train_ids)
    seen: set[int] = set()
    step = 0
    while seen != set(train_ids):
        for cursor in range(step * micro, (step + 1) * micro):
            seen.update(micro_batch_at(buckets, cursor, seed))
        step += 1
    return step


def test_steps_per_epoch_is_the_steps_the_stream_takes_to_see_every_sample():
    rng = random.Random(3)
    for _ in range(60):
        lengths = [rng.randint(1, 90) for _ in range(rng.randint(2, 60))]
        train_ids, _ = split_indices(len(lengths), rng.choice([0.0, 0.1, 0.3]), seed=rng.randint(0, 9))
        budget, micro, seed = rng.randint(16, 400), rng.randint(1, 6), rng.randint(0, 9)
        want = brute_force_steps(lengths, train_ids, budget, micro, seed)
        assert steps_per_epoch(lengths, train_ids, budget, micro) == want, (lengths, budget, micro)


@pytest.fixture(scope="module")
def store_recipe(tmp_path_factory, tiny_verifier_dir):
    tmp = tmp_path_factory.mktemp("epochs")
    recipe = collected_recipe(tmp, tiny_verifier_dir, save_every=1000, eval_every=1000)
    path = tmp / "recipe.yaml"
    path.write_text(dump_recipe(recipe))
    return recipe, path


def test_epochs_set_max_steps_from_the_store_and_say_so(store_recipe, monkeypatch, capsys):
    recipe, path = store_recipe
    converted = epoch_steps(recipe, 2)
    train_ids, _ = split_indices(12, recipe.train.val_fraction, recipe.train.seed)  # its 12 rows
    assert converted.train_samples == len(train_ids)
    assert converted.max_steps == 2 * converted.steps_per_epoch > 0
    code, out, err = run_main(monkeypatch, capsys, "train", str(path), "--epochs", "2", "--lr", "0.02")
    assert code == 0, err
    assert f"--epochs 2: 2 x {converted.steps_per_epoch} steps (" in err
    assert f"= train.max_steps {converted.max_steps}" in err
    checkpoint = latest_checkpoint(recipe.run_dir / "drafters" / "dflash" / "checkpoints")
    saved = saved_recipe(checkpoint)
    assert (saved.train.max_steps, saved.train.lr) == (converted.max_steps, 0.02)
    assert checkpoint.name == f"step-{converted.max_steps}"
    half = epoch_steps(recipe, 0.5)  # a part of an epoch rounds up, never to 0 steps
    assert half.max_steps == max(1, -(-converted.steps_per_epoch // 2))


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--epochs", "1", "--max-steps", "3"], "--max-steps and --epochs both set the number of steps"),
        (["--epochs", "0"], "--epochs 0: need a positive number"),
        (["--epochs", "1", "--set", "train.mode=online"], "train.mode=online has none; pass --max-steps"),
        (
            ["--max-steps", "5", "--set", "train.per_algo.dflash.max_steps=9"],
            "train.per_algo.dflash.max_steps (9)",
        ),
        (["--lr", "fast"], "Invalid value for '--lr'"),
        (["--max-steps", "0"], "train.max_steps"),  # the schema's own bound (ge=1), as --set says it
    ],
)
def test_alias_errors_are_one_line_exit_2(store_recipe, monkeypatch, capsys, args, needle):
    _, path = store_recipe
    code, _, err = run_main(monkeypatch, capsys, "train", str(path), *args)
    assert code == 2 and needle in err, err


def test_the_aliases_are_the_recipe_fields(store_recipe):
    """--lr 0.02 and --set train.lr=0.02 load the same recipe (the flag adds no setting of its own)."""
    from specctl.cli import _train_recipe
    from specctl.recipe import load_recipe

    _, path = store_recipe
    assert _train_recipe(str(path), [], 0.02, 7, None) == load_recipe(
        str(path), ["train.lr=0.02", "train.max_steps=7"]
    )
    assert yaml.safe_load(dump_recipe(_train_recipe(str(path), [], None, None, None)))["train"]["lr"] == 3e-3
