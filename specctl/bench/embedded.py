"""The embedded backend of `specctl bench`: specctl.engine.generate, batch 1, in this process.

Every drafter stays loaded, so the methods can take turns prompt by prompt (the run interleaves
them); each method is warmed up once, on the first prompt it sees, before it is timed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specctl.bench.client import Answer, Sent
from specctl.bench.plan import Groups, Method
from specctl.bench.prompts import BenchPrompt
from specctl.bench.report import Measurement, MethodResult, Point, Unit
from specctl.bench.spec import BackendSpec, Opening
from specctl.counters import SpecCounters
from specctl.drafters.api import Drafter
from specctl.kernels import apply_kernel
from specctl.recipe import BenchSection, VerifierSection


def engine_answer(tokens: list[int], wall_s: float, step_times_s: list[float]) -> Answer:
    """One engine decode as the server path's streamed Answer: each verifier step's tokens are a
    chunk (vLLM streams a step's accepted tokens together), so TTFT is the prefill step's time, ITL
    the gaps between steps and TPOT (end - TTFT) / (tokens - 1), by the same definitions
    (specctl.bench.client) as `vllm bench serve`."""
    itl = [b - a for a, b in zip(step_times_s, step_times_s[1:], strict=False)]
    return Answer(len(tokens), list(tokens), step_times_s[0], wall_s, itl)


class EmbeddedBackend:
    """measure(method, prompts): each prompt decoded alone, engine-timed (prefill + decode, and each
    step's time for TTFT / ITL / TPOT, `engine_answer`); the
    generated ids are kept (the report compares them with plain decoding's), and each prompt is one
    Unit (round 0: the run says which repetition it was)."""

    levels = (1,)

    def __init__(
        self,
        section: VerifierSection,
        settings: BenchSection,
        on_done: Callable[[int], None] | None = None,
        generate_fn: Callable[..., Any] | None = None,
        load_drafter_fn: Callable[..., tuple[Drafter, Any]] | None = None,
    ):
        from specctl.data.generate import stop_token_ids
        from specctl.verifier import load_verifier

        self.verifier = load_verifier(section)
        # one kernel for every forward of the run: plain decoding's, the verifies', the drafters'
        self.kernel = apply_kernel(self.verifier.model, settings.linear_kernel)
        self.tokenizer = self.verifier.tokenizer
        self.stop_ids = list(stop_token_ids(self.tokenizer, self.verifier.model))
        self.settings, self.on_done = settings, on_done
        if generate_fn is None:
            from specctl.engine import generate as generate_fn
        if load_drafter_fn is None:
            from specctl.speculators.io import load_drafter

            def load_drafter_fn(path: Path, verifier: Any) -> tuple[Drafter, Any]:
                return load_drafter(path, verifier=verifier)

        self.generate_fn, self.load_drafter_fn = generate_fn, load_drafter_fn
        self.loaded: dict[Path, Drafter] = {}  # every drafter stays loaded: methods take turns
        self.warmed: set[Method] = set()
        self.estimators: dict[Method, Any] = {}  # adaptive configurations' acceptance estimators

    def _drafter(self, method: Method) -> Drafter | None:
        if method.drafter is None:
            return None
        if method.drafter not in self.loaded:
            drafter = self.load_drafter_fn(method.drafter, self.verifier)[0]
            if isinstance(drafter, torch.nn.Module):  # a test's stand-in may be a plain object
                apply_kernel(drafter, self.kernel)
            self.loaded[method.drafter] = drafter
        return self.loaded[method.drafter]

    @property
    def engine_info(self) -> dict[str, Any]:
        """The report's provenance.engine: the dtype and matmul kernel every forward ran with,
        (bench.adaptive on) the survival threshold adaptive configurations were cut at, and
        (bench.verify_attention batched) that verify blocks were attended in one call."""
        info: dict[str, Any] = {
            "dtype": str(self.verifier.dtype).removeprefix("torch."),
            "linear_kernel": self.kernel,
        }
        if self.settings.adaptive != "off":
            info["adaptive_threshold"] = self.settings.adaptive_threshold
        if self.settings.verify_attention != "exact":  # absent: exact, as every report before it
            info["verify_attention"] = self.settings.verify_attention
        return info

    def _run(
        self, method: Method, drafter: Drafter | None, index: int, prompt: BenchPrompt, max_new_tokens: int
    ) -> Any:
        s, attention = self.settings.sampling, self.settings.verify_attention
        return self.generate_fn(
            self.verifier,
            drafter,
            list(prompt.prompt_ids),
            max_new_tokens=max_new_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            seed=s.prompt_seed(index),
            num_speculative_tokens=method.num_speculative_tokens or None,
            eos_token_ids=self.stop_ids,
            # only when set: an engine (or a test's stand-in) without dynamic draft length, or
            # without batched verify attention, still runs
            **self._cut(method, drafter),
            **({} if attention == "exact" else {"verify_attention": attention}),
        )

    def _cut(self, method: Method, drafter: Drafter | None) -> dict[str, Any]:
        """The engine's draft-cut arguments for a configuration: DSpark's confidence threshold, a
        draft tree's node count, or
        adaptive verification at bench.adaptive_threshold with the configuration's estimator (one
        per configuration for the whole run, as vLLM keeps one per engine)."""
        if method.confidence_threshold is not None:
            return {"confidence_threshold": method.confidence_threshold}
        if method.tree_nodes is not None:
            return {"tree_nodes": method.tree_nodes}
        if not method.adaptive:
            return {}
        if method not in self.estimators:
            from specctl.acceptance import AcceptanceEstimator
            from specctl.engine import default_num_speculative_tokens

            K = method.num_speculative_tokens or default_num_speculative_tokens(drafter)
            self.estimators[method] = AcceptanceEstimator(K)
        return {"adaptive_threshold": self.settings.adaptive_threshold, "estimator": self.estimators[method]}

    def measure(self, method: Method, groups: Groups) -> list[Point]:
        drafter = self._drafter(method)
        if method not in self.warmed:  # warm-up, not measured
            first = next(p for g in groups.values() for p in g)
            self._run(method, drafter, first[0], first[1], min(4, self.settings.sampling.max_new_tokens))
            self.warmed.add(method)
        categories = {}
        for category, prompts in groups.items():
            m, timed = Measurement(), Sent()
            for index, prompt in prompts:
                r = self._run(method, drafter, index, prompt, self.settings.sampling.max_new_tokens)
                c = r.counters
                counters = SpecCounters(
                    c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, list(c.accepted_per_position)
                )
                # the ids include the EOS when it stopped the answer, as output_tokens counts it
                unit = Unit(index, 0, 1, len(r.tokens), r.wall_s, c.num_drafts, c.num_accepted_tokens)
                ids = {index: [int(t) for t in r.tokens]}
                m = m + Measurement(1, len(r.tokens), r.wall_s, counters, ids, units=[unit])
                timed.add(index, engine_answer(r.tokens, r.wall_s, r.step_times_s))
                if self.on_done:
                    self.on_done(len(r.tokens))
            m.ttft_s, m.tpot_s, m.itl_s = timed.ttft_s, timed.tpot_s, timed.itl_s
            categories[category] = m
        return [Point(1, MethodResult(method, categories))]


def open_embedded(o: Opening) -> EmbeddedBackend:
    """The verifier loads here, in this process (specctl.verifier)."""
    return EmbeddedBackend(o.section, o.settings, o.on_done, o.generate_fn, o.load_drafter_fn)


SPEC = BackendSpec(
    name="embedded",
    title="specctl's embedded engine",
    open=open_embedded,
    interleave=True,  # switching methods is free: they take turns prompt by prompt
    counts_passes=True,  # every repetition decodes each prompt again
    latency="specctl's embedded engine: each verifier step's tokens as one streamed chunk",
    why_one_level="decodes one request at a time",
    fixed_level=1,
    why_no_engine_rounds="takes turns prompt by prompt already",
    confidence_thresholds=True,
    adaptive="engine",
    trees=True,
    verify_attention=True,
)
