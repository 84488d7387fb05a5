"""What a benchmark measures, decided before anything decodes: pure functions over settings and files.

A run compares configurations (`Method`: plain decoding, a drafter directory at one K, vLLM's
ngram) on one verifier and one prompt set: plain decoding first (the denominator of every
speedup), then the EAGLE-3 baseline when there is one (the reference of "vs EAGLE-3"), then the
other drafters. A sweep expands each drafter into several K; the embedded engine's methods take
turns prompt by prompt (`prompt_rounds`). Everything algorithm-specific -- the most K a drafter can
draft, its vLLM speculative config -- comes from its `DrafterSpec`.

A new dimension (a DSpark confidence threshold, say) is another `Method` field that
`plan_sweep` expands and the backends read; nothing else changes shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specctl.bench.prompts import BenchPrompt
from specctl.errors import SpecctlError, UsageError
from specctl.recipe import BUILTIN_RECIPES, BenchSection, Recipe, VerifierSection

if TYPE_CHECKING:
    from specctl.drafters import DrafterConfig

SERVER = "server"  # the algo, and the name, of the one method a remote run measures: the server as it runs
BASELINE = "eagle3"  # the reference algorithm of "vs EAGLE-3" (--baseline names another directory)
PLAIN = "none"  # the `algo` of plain decoding, the denominator of every speedup
PLAIN_NAME = "no-spec"
NGRAM = "ngram"
NGRAM_METHOD = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}

Groups = dict[str, list[tuple[int, BenchPrompt]]]  # category -> (prompt index, prompt)


@dataclass(frozen=True)
class Method:
    """One configuration to benchmark: plain decoding, a drafter directory, or vLLM's ngram."""

    name: str  # unique in a report; what `--require NAME.field>=x` refers to
    algo: str  # speculators_model_type, "ngram", or "none"
    num_speculative_tokens: int = 0
    drafter: Path | None = None
    verifier: str | None = None  # the verifier the drafter records (speculators_config.verifier)
    # dynamic draft length: verify only the drafts whose confidence product stays >= this (None = all K)
    confidence_threshold: float | None = None
    # adaptive verification: vLLM's enable_adaptive_verification, or the embedded engine's cut at
    # bench.adaptive_threshold (the confidence head, else vLLM's estimator on the drafter's logits)
    adaptive: bool = False
    # a draft tree of at most this many nodes, made as the drafter's spec says (None: a chain)
    tree_nodes: int | None = None
    # the drafter's own config, parsed once from its config.json by `drafter_method`: the K limit
    # and the confidence head are read from it, not from the file again (None without a drafter)
    drafter_config: DrafterConfig | None = field(default=None, compare=False, repr=False)


# ---------------------------------------------------------------- settings and methods


AUTO_REPEATS = 3  # rounds when bench.repeats is unset and the run is short (`default_repeats`)
AUTO_REPEAT_TOKENS = 4096  # "short": at most this many tokens decoded per round, all configurations


def default_repeats(num_prompts: int, max_new_tokens: int, configs: int, levels: int = 1) -> int:
    """Rounds for a run that leaves bench.repeats unset: AUTO_REPEATS when one round decodes at
    most AUTO_REPEAT_TOKENS tokens (prompts x max_new_tokens x configurations x concurrency
    levels), else 1. Three rounds give a median and an interval that sees machine drift; a run
    past the bound (a K sweep, long answers) would triple a wait that already takes minutes."""
    tokens = num_prompts * max_new_tokens * configs * levels
    return AUTO_REPEATS if tokens <= AUTO_REPEAT_TOKENS else 1


def rate_cap(recipe: Recipe | None, settings: BenchSection) -> int:
    """Requests in flight at most under --request-rate when no --concurrency is given: the
    recipe's bench.concurrency where it sets one, else every prompt (no cap, as `vllm bench
    serve` without --max-concurrency)."""
    if recipe is not None and "concurrency" in recipe.bench.model_fields_set:
        return settings.concurrency
    return settings.num_prompts


def drafter_setting(text: str | Path) -> tuple[Path, int | None, float | None]:
    """`DIR`, `DIR@K` or `DIR@K,T`: a drafter directory and the K (and confidence threshold) to run it
    at instead of its exported K -- how a setting chosen on dev prompts is carried to the test run
    (benchmarks/results.py) without rewriting the export. A directory whose own name holds `@` is
    taken as it is."""
    where = str(text)
    if Path(where).exists() or "@" not in where:
        return Path(where), None, None
    directory, setting = where.rsplit("@", 1)
    k_text, _, t_text = setting.partition(",")
    try:
        k, t = int(k_text), float(t_text) if t_text else None
    except ValueError:
        raise UsageError(f"--drafter {where}: expected DIR, DIR@K or DIR@K,T (e.g. export@3,0.1)") from None
    if k < 1 or (t is not None and not 0 < t < 1):
        raise UsageError(f"--drafter {where}: K is 1 or more and T a probability in (0, 1)")
    return Path(directory), k, t


def drafter_method(path: str | Path) -> Method:
    """A Method for a speculators-format directory (ours or a third party's), at the K (and
    threshold) a `DIR@K[,T]` suffix pins (drafter_setting)."""
    from specctl.speculators.validate import read_config

    directory, k, threshold = drafter_setting(path)
    if not directory.exists():
        raise UsageError(
            f"--drafter {directory}: no such directory; pass a speculators export (config.json + weights)"
        )
    spec, config = read_config(directory)
    algo = config.speculators_model_type
    method = Method(
        algo,
        algo,
        config.speculative_tokens if k is None else k,
        directory,
        config.verifier_name,
        drafter_config=spec.config_from_format(config),
        confidence_threshold=threshold,
    )
    limit = k_range(method)[0]
    if k is not None and limit is not None and k > limit:
        raise UsageError(
            f"--drafter {path}: {algo} drafts at most {limit} tokens per step; pin a K in 1..{limit}"
        )
    if threshold is not None and not reports_confidence(method):
        raise UsageError(f"--drafter {path}: {algo} has no confidence head; drop the threshold (`@{k}`)")
    return method


def _drafter_config(method: Method) -> DrafterConfig:
    """The parsed config a drafter Method carries; a Method built by hand has none to ask."""
    if method.drafter_config is None:
        raise ValueError(f"{method.name}: built without its drafter config; build it with drafter_method")
    return method.drafter_config


def exported_drafters(run_dir: Path) -> list[Path]:
    """Every runs/<name>/drafters/<algo>/export that holds a config.json."""
    return sorted(p for p in (run_dir / "drafters").glob("*/export") if (p / "config.json").is_file())


def _unique_names(methods: list[Method]) -> list[Method]:
    seen: dict[str, int] = {}
    out = []
    for m in methods:
        seen[m.name] = seen.get(m.name, 0) + 1
        out.append(m if seen[m.name] == 1 else replace(m, name=f"{m.name}-{seen[m.name]}"))
    return out


def plan_methods(
    drafters: Sequence[Path], baseline: Path | None, ngram: int | None = None
) -> tuple[list[Method], str | None]:
    """[no-spec, baseline, drafters..., ngram] with unique names, and the baseline's name.

    Without --baseline, an EAGLE-3 drafter among `drafters` is the reference.
    """
    methods = [Method(PLAIN_NAME, PLAIN)]
    base = drafter_method(baseline) if baseline is not None else None
    if base is not None:
        methods.append(base)
    methods += [
        drafter_method(d) for d in drafters if base is None or Path(d).resolve() != base.drafter.resolve()
    ]
    if base is None:  # an EAGLE-3 drafter among the drafters is the reference; list it first
        base = next((m for m in methods if m.algo == BASELINE), None)
        if base is not None:
            methods.remove(base)
            methods.insert(1, base)
    if ngram is not None:
        methods.append(Method(NGRAM, NGRAM, ngram))
    methods = _unique_names(methods)
    base_name = None
    if base is not None:
        base_name = next(m.name for m in methods if m.drafter is not None and m.drafter == base.drafter)
    return methods, base_name


def display_name(method: Method, sweeping: bool) -> str:
    """How progress and errors name a configuration: the method, and its K (and confidence
    threshold) in a sweep."""
    name = method.name
    if sweeping and method.algo != PLAIN:
        name = f"{name} K={method.num_speculative_tokens}"
    if method.confidence_threshold is not None:
        name = f"{name} T={method.confidence_threshold:g}"
    if method.adaptive:
        name = f"{name} adaptive"
    return name  # a tree's node count is in its name (plan_trees)


# ---------------------------------------------------------------- vLLM's view of a method


def speculative_config(method: Method) -> dict[str, Any] | None:
    """vLLM's --speculative-config for a method (None = plain decoding), from the drafter's spec."""
    from specctl.drafters import DRAFTERS

    if method.algo == PLAIN:
        return None
    by_type = {s.speculators_model_type: s.vllm_method for s in DRAFTERS.values() if s.vllm_method}
    by_type[NGRAM] = NGRAM_METHOD
    if method.algo not in by_type:
        known = ", ".join(sorted(k for k in by_type if k != NGRAM))
        raise SpecctlError(
            f"{method.drafter or method.name}: vLLM has no method for speculators_model_type "
            f"{method.algo!r} (known: {known})"
        )
    cfg = dict(by_type[method.algo])
    if method.drafter is not None:
        cfg["model"] = str(Path(method.drafter).resolve())
    cfg["num_speculative_tokens"] = method.num_speculative_tokens
    if method.adaptive:
        cfg["enable_adaptive_verification"] = True
    return cfg


# ---------------------------------------------------------------- the K sweep


def parse_int_list(text: str, option: str) -> list[int]:
    """`1,4,16` or `1-4,7` -> sorted distinct positive integers (a command-line list)."""
    values: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise UsageError(
                f"{option} {text!r}: expected positive integers like 1,2,4 or a range like 1-4"
            ) from None
        if first < 1 or last < first:
            raise UsageError(f"{option} {text!r}: {part.strip()!r} is not a positive integer or rising range")
        values.update(range(first, last + 1))
    return sorted(values)


def parse_float_list(text: str, option: str) -> list[float]:
    """`0.2,0.4` -> sorted distinct numbers (a command-line list)."""
    try:
        values = {float(part) for part in text.split(",")}
    except ValueError:
        raise UsageError(f"{option} {text!r}: expected numbers like 0.2,0.4") from None
    return sorted(values)


def parse_sweep_k(text: str) -> bool | list[int]:
    """--sweep-k: `all` (True: every K each drafter can draft) or the K values to measure."""
    return True if text.strip().lower() == "all" else parse_int_list(text, "--sweep-k")


def k_range(method: Method) -> tuple[int | None, int]:
    """(the most K the method can draft or None, the top of its default sweep), as its drafter's
    spec says: block drafters fill one block per pass, P-EAGLE has its trained depths, EAGLE-3
    drafts any K (the acceptance past its training depth falls, which is what a sweep shows). The
    default sweep stops at the limit, else at the exported K or the trained depth, whichever is
    larger; an explicit --sweep-k list can go further."""
    if method.drafter is None:  # ngram drafts from the prompt: any K, default up to --ngram K
        return None, method.num_speculative_tokens
    drafter = _drafter_config(method)
    limit = drafter.max_speculative_tokens()
    if limit is not None:
        return limit, limit
    return None, max(method.num_speculative_tokens, drafter.trained_speculative_tokens())


def plan_sweep(methods: Sequence[Method], sweep_k: bool | Sequence[int]) -> tuple[list[Method], list[str]]:
    """The configurations to measure, in order, and one line per requested K a drafter cannot draft.

    sweep_k: False = each method at its exported K; True = each drafter at 1..its default top
    (k_range); a list = those K, minus those above a drafter's limit. Plain decoding is measured
    once. A drafter left with no K fails here, before any decoding.
    """
    if not isinstance(sweep_k, bool) and (not sweep_k or min(sweep_k) < 1):
        raise UsageError(f"--sweep-k {list(sweep_k)}: give K values of 1 or more, or all")
    configs: list[Method] = []
    skipped: list[str] = []
    for m in methods:
        if m.algo == PLAIN or sweep_k is False or m.confidence_threshold is not None:
            configs.append(m)
            continue
        limit, top = k_range(m)
        ks = list(range(1, top + 1)) if sweep_k is True else sorted(set(sweep_k))
        over = [k for k in ks if limit is not None and k > limit]
        if len(over) == len(ks):
            raise UsageError(
                f"--sweep-k: {m.name} ({m.drafter}) drafts at most {limit} tokens per step; "
                f"include a K in 1..{limit}"
            )
        if over:
            skipped.append(
                f"{m.name}: K={','.join(map(str, over))} not measured, it drafts at most {limit} per step"
            )
        configs += [replace(m, num_speculative_tokens=k) for k in ks if k not in over]
    return configs, skipped


# ---------------------------------------------------------------- the confidence threshold


def reports_confidence(method: Method) -> bool:
    """Whether the method's drafter reports per-position confidences (its spec's config says)."""
    return method.drafter is not None and _drafter_config(method).reports_confidence()


def plan_thresholds(
    configs: Sequence[Method], thresholds: Sequence[float], sweeping: bool
) -> tuple[list[Method], list[str]]:
    """Expand the configurations over DSpark-style confidence thresholds, and one line per drafter
    the thresholds cannot apply to.

    For a drafter that reports confidences: in a sweep (several thresholds, or K / concurrency
    swept), its fixed-K configuration is kept -- the reference a threshold must beat -- and one
    configuration per threshold is added at each K; otherwise (one threshold, no sweep) that
    threshold replaces the fixed K. Other drafters are measured as they are.
    """
    if not thresholds:
        return list(configs), []
    bad = [t for t in thresholds if not 0 < t < 1]
    if bad:
        raise UsageError(f"--confidence-threshold {bad[0]:g}: a threshold is a probability in (0, 1)")
    out: list[Method] = []
    unable: dict[str, None] = {}
    for m in configs:
        if m.confidence_threshold is not None:  # pinned by `--drafter DIR@K,T`: measured as given
            out.append(m)
            continue
        if not reports_confidence(m):  # False without a drafter (plain)
            out.append(m)
            if m.algo != PLAIN:
                unable[m.name] = None
            continue
        if sweeping:
            out.append(m)
        out += [replace(m, confidence_threshold=t) for t in sorted(set(thresholds))]
    notes = [f"{name}: no confidence head, --confidence-threshold does not apply" for name in unable]
    return out, notes


# ---------------------------------------------------------------- adaptive verification


def plan_adaptive(configs: Sequence[Method], mode: str) -> tuple[list[Method], list[str]]:
    """Expand the configurations over adaptive verification (bench.adaptive), and one line per
    method it does not apply to.

    mode `off`: as they are; `on`: each drafter's configurations become adaptive; `both`: each
    adaptive one follows its fixed-K twin, so the report compares them at every K and level.
    Plain decoding, ngram (vLLM adapts the draft of model drafters only) and a configuration
    already cut by a confidence threshold (`--drafter DIR@K,T`, --confidence-threshold) stay as
    they are."""
    if mode == "off":
        return list(configs), []
    out: list[Method] = []
    unable: dict[str, None] = {}
    for m in configs:
        if m.drafter is None or m.confidence_threshold is not None:
            out.append(m)
            if m.algo == NGRAM:
                unable[m.name] = None
            continue
        out += [m, replace(m, adaptive=True)] if mode == "both" else [replace(m, adaptive=True)]
    return out, [f"{name}: --adaptive does not apply (no drafter model)" for name in unable]


# ---------------------------------------------------------------- draft trees


def plan_trees(configs: Sequence[Method], tree_nodes: Sequence[int]) -> tuple[list[Method], list[str]]:
    """Add, after each drafter's chain configuration, one tree configuration per node count (a
    method of its own, `<name>-treeN`, so the report compares chain and tree side by side) for
    every drafter whose spec makes trees (`DrafterSpec.tree`: parallel drafters from their block
    distributions, EAGLE-3 by its top-k expansion), and one line per configuration a tree does
    not apply to: ngram (no drafter model), a drafter whose spec makes none, and configurations
    already cut by a confidence threshold or adaptive verification."""
    if not tree_nodes:
        return list(configs), []
    from specctl.drafters import DRAFTERS

    growing = {s.speculators_model_type for s in DRAFTERS.values() if s.tree is not None}
    out: list[Method] = []
    unable: dict[str, str] = {}
    for m in configs:
        out.append(m)
        if m.algo == PLAIN:
            continue
        if m.drafter is None or m.algo not in growing:
            unable[m.name] = "no drafter model that makes draft trees"
        elif m.adaptive or m.confidence_threshold is not None:
            unable[m.name] = "its draft length is cut; a tree replaces the cut"
        else:
            out += [replace(m, name=f"{m.name}-tree{n}", tree_nodes=n) for n in sorted(set(tree_nodes))]
    return out, [f"{name}: --tree does not apply ({why})" for name, why in unable.items()]


def chain_name(method: Method) -> str:
    """The name of the chain configuration a tree was planned beside (plan_trees names a tree
    `<chain>-treeN`); a chain's own name otherwise. What groups a drafter's chain and trees when
    the report recommends one of them."""
    if method.tree_nodes is None:
        return method.name
    return method.name.removesuffix(f"-tree{method.tree_nodes}")


# ---------------------------------------------------------------- the verifier


def same_verifier(a: str, b: str) -> bool:
    from specctl.verifier import builtin_alias

    def norm(x: str) -> str:
        p = Path(x).expanduser()
        return builtin_alias(x) or (str(p.resolve()) if p.is_dir() else x.lower())

    return norm(a) == norm(b)


def choose_verifier(
    recipe: Recipe | None, methods: Sequence[Method], override: str | None, warn: Callable[[str], None]
) -> str:
    """--verifier, else the recipe's, else the one the drafters record (they must agree)."""
    recorded = [(m, m.verifier) for m in methods if m.drafter is not None]
    if override is None and recipe is None:
        missing = [str(m.drafter) for m, v in recorded if not v]
        if missing:
            raise UsageError(
                f"{missing[0]}: config.json records no speculators_config.verifier.name_or_path; "
                "pass --verifier"
            )
        chosen = recorded[0][1]
        for m, v in recorded[1:]:
            if not same_verifier(v, chosen):
                raise UsageError(
                    f"the drafters were trained for different verifiers ({recorded[0][0].drafter}: {chosen}; "
                    f"{m.drafter}: {v}); benchmark them separately or pass --verifier"
                )
        return chosen
    chosen = override if override is not None else recipe.verifier.name_or_path
    for m, v in recorded:
        if v and not same_verifier(v, chosen):
            warn(f"warning: {m.drafter} was trained for {v}, benchmarking it on {chosen}")
    return chosen


def verifier_config(section: VerifierSection) -> Any | None:
    """The verifier's config.json (AutoConfig, no weights); None when it cannot be read here (the
    backend that loads the verifier then says why)."""
    from transformers import AutoConfig

    from specctl.verifier import locate_verifier

    try:
        source, _ = locate_verifier(section.name_or_path, section.revision)
        return AutoConfig.from_pretrained(
            source, revision=section.revision, trust_remote_code=section.trust_remote_code
        )
    except (OSError, ValueError, SpecctlError):
        return None


def check_drafters(methods: Sequence[Method], section: VerifierSection) -> None:
    """Every drafter readable -- config.json parsed, weights' headers read (a truncated file
    fails here), tensors as the config describes -- and shaped for the verifier, before anything
    decodes: a bad drafter must not cost the plain-decoding run first."""
    from specctl.speculators.validate import validate_export

    config = verifier_config(section)
    for m in methods:
        if m.drafter is None:
            continue
        export = validate_export(m.drafter, check_values=False)
        if config is None:
            continue
        layer = export.config.layer
        want = (getattr(config, "vocab_size", None), getattr(config, "hidden_size", None))
        if (layer.vocab_size, layer.hidden_size) != want:
            raise SpecctlError(
                f"{m.drafter}: drafts for a verifier with vocabulary {layer.vocab_size} and hidden size "
                f"{layer.hidden_size}, {section.name_or_path} has {want[0]} and {want[1]}; "
                "pass the verifier it was trained for (--verifier)"
            )


def no_drafter_message(recipe: Recipe) -> str:
    ref = recipe.name if (BUILTIN_RECIPES / f"{recipe.name}.yaml").is_file() else "RECIPE.yaml"
    return (
        f"no drafter to benchmark in {recipe.run_dir}/drafters/*/export; make one with "
        f"`specctl collect-hidden-states {ref} && specctl train {ref} --algo dflash && "
        f"specctl export {recipe.run_dir}`, or pass --drafter DIR"
    )


# ---------------------------------------------------------------- prompts and rounds


def group_prompts(prompts: Sequence[BenchPrompt]) -> Groups:
    """category -> [(index, prompt)]; one "" group when no prompt has a category."""
    categorized = any(p.category for p in prompts)
    groups: Groups = {}
    for i, p in enumerate(prompts):
        key = (p.category or "uncategorized") if categorized else ""
        groups.setdefault(key, []).append((i, p))
    return dict(sorted(groups.items()))


def prompt_rounds(groups: Groups, interleave: bool, engine_rounds: int = 1) -> list[Groups]:
    """The rounds the methods take turns on. Interleaved (the embedded engine, where switching
    methods is free): one prompt a round, every method decodes it before the next prompt, so a slow
    spell of the machine (another job, CPU steal) falls on every method alike rather than on
    whichever ran then. A vLLM engine costs a start per method: `engine_rounds` rounds (one by
    default, never more than there are prompts), the prompts dealt out in turn so that each round
    holds every category in proportion."""
    flat = sorted((i, category, p) for category, prompts in groups.items() for i, p in prompts)
    if interleave:
        return [{category: [(i, p)]} for i, category, p in flat]
    if engine_rounds <= 1:
        return [groups]
    rounds: list[Groups] = [{} for _ in range(min(engine_rounds, len(flat)))]
    for k, (i, category, p) in enumerate(flat):
        rounds[k % len(rounds)].setdefault(category, []).append((i, p))
    return rounds


def repeat_rounds(rounds: Sequence[Groups], repeats: int, interleave: bool) -> list[tuple[int, Groups]]:
    """(repetition, prompts) in the order they are measured. Interleaved (the embedded engine):
    every prompt round once per repetition, repetition after repetition, so each method decodes
    every prompt `repeats` times and the methods take turns throughout. An engine backend repeats
    inside each configuration's engine (one start, `repeats` passes: bench.repeats reaches it
    through the settings), so its rounds are measured once, as repetition 0: the passes of
    different methods are then not interleaved (--engine-rounds interleaves engines)."""
    if not interleave:
        return [(0, chunk) for chunk in rounds]
    return [(r, chunk) for r in range(repeats) for chunk in rounds]


def round_order(
    configs: Sequence[Method], round_index: int, interleave: bool, repetition: int = 0
) -> list[Method]:
    """The order the configurations take in a round: engine rounds alternate it (A B C, then
    C B A), so no configuration always runs first or last, when a machine tends to be warmer
    or busier; interleaved rounds (one prompt each) keep it within a repetition, rotated by one
    each repetition (A B C, then B C A, then C A B), so each method runs first on some pass."""
    if interleave:
        shift = repetition % len(configs) if configs else 0
        return list(configs[shift:]) + list(configs[:shift])
    return list(configs) if round_index % 2 == 0 else list(reversed(configs))


def reported_rounds(rounds_done: Sequence[int]) -> int:
    """How many rounds a report covers, given the rounds each configuration still measured has
    finished: those all of them finished, so every method compares on the same prompts; before
    any round is complete, the first (the configurations that finished it)."""
    return max(1, min(rounds_done, default=0))


def max_model_len(groups: Groups, max_new_tokens: int, max_k: int, limit: int | None) -> int:
    """Context vLLM must hold: the longest prompt, the answer, a draft block of slack (rounded up)."""
    need = max(len(p.prompt_ids) for g in groups.values() for _, p in g) + max_new_tokens + max_k + 16
    need = -(-need // 256) * 256
    return min(need, limit) if limit else need
