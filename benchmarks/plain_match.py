"""`= plain` of the embedded engine with the verifier's attention as it is and as it was.

Greedy speculation must emit plain decoding's tokens. This decodes the builtin bench prompts with
the real SmolLM2-135M-Instruct verifier, plain and speculating, with two drafters that need no
training: `random` (uniform tokens, nearly all rejected: every emitted token is row 0 of a K+1-row
verify) and `plain-70` (plain decoding's own next tokens, each replaced by a random one with
probability 0.3: drafts are often accepted, so rows 1..K and their KV entries decide too). Each runs
with attention `row-by-row` (specctl.verifier: a verify block's rows as one-token steps) and
`block` (one SDPA call over the block, as before), in the same process, and every divergence is
classified (specctl.bench.divergence). Usage:

    python -m benchmarks.plain_match [--dtype bfloat16,float32] [--prompts 8] [--max-new-tokens 64]
        [--time-only]  (first: one verify forward's cost per attention mode and row count)
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

import specctl.verifier as verifier_module
from specctl.bench.divergence import find_divergences
from specctl.bench.prompts import load_prompts
from specctl.data.generate import stop_token_ids
from specctl.devices import cpu_bf16_kind
from specctl.engine import generate
from specctl.kernels import apply_kernel
from specctl.recipe import VerifierSection


class Drafts:
    """Drafts without a trained drafter: random tokens, or `plain`'s next tokens each replaced by a
    random one with probability `noise` (drafts follow plain decoding's output by position)."""

    def __init__(self, vocab_size: int, k: int, plain: list[int] | None, prompt_len: int, noise: float):
        self.vocab_size, self.k, self.plain, self.prompt_len, self.noise = (
            vocab_size,
            k,
            plain,
            prompt_len,
            noise,
        )
        self.generator = torch.Generator().manual_seed(0)
        self.verifier = type("Spec", (), {"aux_layer_ids": (2,)})()

    def export_config(self):
        return type("Export", (), {"speculative_tokens": self.k})()

    def propose_with_logits(
        self, ids: torch.Tensor, aux: torch.Tensor, k: int, state: dict
    ) -> tuple[torch.Tensor, None]:
        """The engine's greedy drafting reads the drafts only: no logits."""
        drafts = torch.randint(0, self.vocab_size, (k,), generator=self.generator)
        if self.plain is None:
            return drafts, None
        start = ids.numel() - self.prompt_len  # output tokens so far
        keep = torch.rand(k, generator=self.generator) >= self.noise
        for i in range(k):
            if keep[i] and start + i < len(self.plain):
                drafts[i] = self.plain[start + i]
        return drafts, None


@contextmanager
def attention(mode: str) -> Iterator[None]:
    """`row-by-row` (as shipped) or `block` (decode_rows off: one SDPA call per verify block)."""
    shipped = verifier_module.decode_rows
    if mode == "block":
        verifier_module.decode_rows = lambda query, key: False
    try:
        yield
    finally:
        verifier_module.decode_rows = shipped


def measure(dtype: str, num_prompts: int, max_new_tokens: int, k: int) -> list[dict]:
    """One row per (drafter, attention): = plain, the divergences' classes, decode wall."""
    verifier = verifier_module.load_verifier(
        VerifierSection(name_or_path="smollm2-135m-instruct", dtype=dtype, device="cpu")
    )
    kernel = apply_kernel(verifier.model, "auto")
    prompts, _ = load_prompts("builtin", verifier.tokenizer, num_prompts, 0)
    stop = list(stop_token_ids(verifier.tokenizer, verifier.model))
    ids = {i: list(p.prompt_ids) for i, p in enumerate(prompts)}
    plain = {
        i: generate(verifier, None, p, max_new_tokens, eos_token_ids=stop).tokens for i, p in ids.items()
    }
    rows = []
    for drafter in ("random", "plain-70"):
        for mode in ("block", "row-by-row"):  # the same drafts for both: each Drafts is seeded
            outputs, wall = {}, 0.0
            with attention(mode):
                for i, p in ids.items():
                    draft = Drafts(
                        verifier.config.vocab_size, k, None if drafter == "random" else plain[i], len(p), 0.3
                    )
                    start = time.perf_counter()
                    outputs[i] = generate(verifier, draft, p, max_new_tokens, eos_token_ids=stop).tokens
                    wall += time.perf_counter() - start
                found = find_divergences(verifier.model, verifier.dtype, ids, plain, outputs, k)
            rows.append(
                {
                    "dtype": dtype,
                    "linear_kernel": kernel,
                    "drafter": drafter,
                    "attention": mode,
                    "equal_plain": sum(outputs[i] == plain[i] for i in ids),
                    "prompts": len(ids),
                    "near_ties": sum(d.near_tie for d in found),
                    "divergences": [d.to_dict() for d in found],
                    "decode_s": wall,
                }
            )
            print(json.dumps({k_: v for k_, v in rows[-1].items() if k_ != "divergences"}), flush=True)
    return rows


def verify_cost(dtype: str, context: int = 150, rounds: int = 5, reps: int = 15) -> dict[str, float]:
    """CPU ms (one thread) of one verifier forward over 1, 2 and 4 new rows after `context` cached
    tokens, per attention mode: the modes and row counts interleaved round by round, the best round's median
    kept (a shared machine's slow spells fall on all alike)."""
    from statistics import median

    from transformers import DynamicCache

    verifier = verifier_module.load_verifier(
        VerifierSection(name_or_path="smollm2-135m-instruct", dtype=dtype, device="cpu")
    )
    apply_kernel(verifier.model, "auto")
    model, prefix = verifier.model, list(range(1000, 1000 + context))
    best: dict[str, float] = {}
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([prefix]), past_key_values=cache, use_cache=True)
        for _ in range(rounds):
            for rows in (1, 2, 4):
                for mode in ("block", "row-by-row"):
                    block = torch.tensor([list(range(5, 5 + rows))])
                    times = []
                    with attention(mode):
                        for _ in range(reps):
                            start = time.process_time()  # CPU time: other jobs' load leaves it be
                            model(input_ids=block, past_key_values=cache, use_cache=True, logits_to_keep=rows)
                            times.append(time.process_time() - start)
                            cache.crop(-rows)
                    key = f"{dtype}.{mode}.rows{rows}_ms"
                    best[key] = min(best.get(key, float("inf")), median(times) * 1e3)
    print(json.dumps(best), flush=True)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16,float32")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--output", default=None)
    parser.add_argument("--context", type=int, default=150, help="cached tokens before the timed forward")
    parser.add_argument("--time-only", action="store_true", help="only the verify forward's cost per mode")
    args = parser.parse_args()
    machine = {"cpu_bf16": cpu_bf16_kind(), "threads": torch.get_num_threads(), "torch": torch.__version__}
    print(json.dumps(machine), flush=True)
    cost = {k: v for d in args.dtype.split(",") for k, v in verify_cost(d, args.context).items()}
    rows = []
    if not args.time_only:
        rows = [
            r for d in args.dtype.split(",") for r in measure(d, args.prompts, args.max_new_tokens, args.k)
        ]
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"machine": machine, "verify_cost": cost, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
