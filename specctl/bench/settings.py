"""A run's bench settings: the recipe's section with the command-line values on top, checked
against what the run's backend can do (its `BackendSpec`).

Every check here asks the spec, and every usage error names the backends whose spec can do what
was asked (`backends.able`), so a backend that gains a capability passes the check and joins the
messages without an edit here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from specctl.bench.arrivals import rate_label
from specctl.bench.backends import able, run_backend, selectable
from specctl.bench.spec import BackendSpec
from specctl.errors import UsageError
from specctl.recipe import BenchSection, Recipe, flag_of


def settings_from_flags(base: BenchSection, given: dict[str, Any]) -> BenchSection:
    """`base` (the recipe's bench section, or the defaults) with the command-line values that were
    passed (not None) on top, validated once: the settings a run then reads whole.

    Bad values are usage errors (exit 2) naming the flag they came from, else the recipe field;
    flags that contradict each other, or that the backend cannot honour, fail here too."""
    given = {k: v for k, v in given.items() if v is not None}
    model = type(base)
    if "backend" in given and given["backend"] not in selectable():
        raise UsageError(f"--backend {given['backend']!r}: choose one of {', '.join(selectable())}")
    if (given.get("base_url") or base.base_url) and "backend" in given:
        raise UsageError(
            f"--backend {given['backend']} starts its own engine; --base-url benches a server that "
            "is already running: pass one of them"
        )
    try:  # the fields the recipe set stay set (rate_cap asks which ones it set)
        settings = model.model_validate({**base.model_dump(exclude_unset=True), **given})
    except ValidationError as e:
        err = e.errors()[0]
        key = str(err["loc"][0])
        if key in given:  # a command-line value: name the flag
            raise UsageError(f"{flag_of(model, key)} {err.get('input')!r}: {err['msg']}") from None
        where = ".".join(map(str, err["loc"]))
        raise UsageError(f"bench.{where}: {err['msg']} (got {err.get('input')!r})") from None
    spec = run_backend(settings)
    if given.get("engine_rounds", 1) > 1 and not spec.engine_rounds:
        raise UsageError(
            f"--engine-rounds {given['engine_rounds']}: the {spec.name} backend {spec.why_no_engine_rounds}; "
            f"drop --engine-rounds or use {able(lambda s: s.engine_rounds)}"
        )
    return settings


def bench_settings(recipe: Recipe | None, **given: Any) -> tuple[BenchSection, BackendSpec]:
    """The recipe's bench section (or the defaults) with the given values on top
    (`settings_from_flags`), and the spec of the backend it runs on (`run_backend`)."""
    settings = settings_from_flags(recipe.bench if recipe is not None else BenchSection(), given)
    return settings, run_backend(settings)


def backend_levels(spec: BackendSpec, asked: list[int] | None, default: int) -> list[int]:
    """The concurrency levels a run measures: those asked (else the settings' one), checked
    against what the backend can sweep."""
    levels = asked or [default]
    if len(levels) > 1 and not spec.levels:
        raise UsageError(
            f"--concurrency {','.join(map(str, levels))}: the {spec.name} backend {spec.why_one_level}; "
            f"sweep concurrency levels with {able(lambda s: s.levels)}"
        )
    return [spec.fixed_level] if spec.fixed_level is not None else levels


def backend_rates(spec: BackendSpec, rates: Sequence[float], asked: list[int] | None) -> list[float]:
    """The request rates a run sends at (bench.request_rate), ascending: a server's queue has
    arrivals to time, an engine that takes the prompts itself has none; and one sweep dimension
    at a time (beside rates, a single --concurrency caps the requests in flight)."""
    if not rates:
        return []
    text = ",".join(rate_label(r) for r in sorted(set(rates)))
    if not spec.request_rates:
        raise UsageError(
            f"--request-rate {text}: the {spec.name} backend has no request arrivals (it "
            f"{spec.why_one_level}); request rates need a server: {able(lambda s: s.request_rates)}"
        )
    if asked and len(asked) > 1:
        raise UsageError(
            f"--request-rate {text} with --concurrency {','.join(map(str, asked))}: sweep one of them; "
            "beside --request-rate, one --concurrency N caps the requests in flight"
        )
    return sorted(set(rates))
