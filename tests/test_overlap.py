"""Bench prompts never in the training plan: the contamination check and the shipped recipes."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from specctl.bench.overlap import SPAN, contaminated, opens_with, shared_span, spans, tokens
from specctl.bench.prompts import BUILTIN_SPLITS, builtin_rows
from specctl.recipe import load_recipe, resolve_recipe_path

SHIPPED = sorted(p.name for p in (Path(__file__).resolve().parents[1] / "specctl" / "recipes").glob("*.yaml"))


def brute_shared(a: str, b: str, n: int) -> bool:
    """Every start in `a` against every start in `b`: the definition, with no sets."""
    ta, tb = tokens(a), tokens(b)
    return any(ta[i : i + n] == tb[j : j + n] for i in range(len(ta) - n + 1) for j in range(len(tb) - n + 1))


def test_tokens_are_lowercased_words_and_single_marks():
    assert tokens("Don't  STOP, now!") == ["don", "'", "t", "stop", ",", "now", "!"]
    assert spans("a b c", 4) == set() and spans("a b c", 3) == {("a", "b", "c")}


@pytest.mark.parametrize("seed", range(20))
def test_shared_span_equals_brute_force(seed):
    rng = random.Random(seed)
    words = ["the", "cat", "sat", "on", "a", "mat", ","]
    a = " ".join(rng.choice(words) for _ in range(rng.randint(0, 30)))
    b = " ".join(rng.choice(words) for _ in range(rng.randint(0, 30)))
    for n in (1, 2, 3, 5):
        found = shared_span(a, b, n)
        assert (found is not None) == brute_shared(a, b, n)
        if found is not None:  # the span it names is really in both
            assert found in " ".join(tokens(a)) and found in " ".join(tokens(b))


def test_contaminated_names_the_prompts_that_share_a_span():
    prompts = ["Write a Python function that counts how often each word appears", "What is 2 + 2?"]
    training = ["user: please write a python function that counts how often each word appears in it"]
    assert contaminated(training, prompts) == {0: "a python function that counts how often each"}
    assert contaminated(["an unrelated conversation about tea"], prompts) == {}


def builtin_texts() -> list[str]:
    return [m["content"] for s in BUILTIN_SPLITS for r in builtin_rows(s) for m in r.messages]


def generation_plan(name: str) -> list[str]:
    """The user-side text a shipped recipe's data stage writes itself: its steers and system prompt."""
    g = load_recipe(resolve_recipe_path(name)).data.generate
    return [p for p in [*g.user_prefixes, g.system_prompt or ""] if p.strip()]


@pytest.mark.parametrize("name", SHIPPED)
def test_no_shipped_generation_plan_copies_a_bench_prompt(name):
    prompts = builtin_texts()
    plan = generation_plan(name)
    assert contaminated(plan, prompts, SPAN) == {}
    # stricter than the span: a steer is not the opening of any built-in prompt (the old list's
    # "Write a Python function" opened two of them, which no 8-token span would catch)
    copied = [(steer, p[:40]) for steer in plan for p in prompts if opens_with(p, steer)]
    assert copied == []


def test_the_opening_check_catches_the_old_steers():
    prompts = builtin_texts()
    for old in ("Write a Python function", "Implement", "Explain what this code does"):
        assert any(opens_with(p, old) for p in prompts)
