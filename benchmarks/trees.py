"""The verify cost curve of draft trees: what one KV-cached verifier forward over a tree of N nodes
costs, against a chain verify of the same number of rows and against one decode step.

Usage: python -m benchmarks.trees [--verifier smollm2-135m-instruct] [--dtype bfloat16] [--prefix 200]
       python -m benchmarks.trees --acceptance DRAFTER_DIR --outputs OUTPUTS.jsonl [--split test]

`--acceptance`: the accepted length per verifier pass of a drafter's chain and of its trees of
each size (a parallel drafter's from its block, EAGLE-3's by its top-k expansion), replayed
exactly along plain decoding's greedy outputs (a bench's outputs.jsonl, method no-spec): greedy
tree verification emits plain decoding's tokens (tests/test_engine_trees.py), so a pass accepts
the longest tree path that matches them, and no verifier pass is needed beyond one forward per
prompt for the drafter's features. The same trajectory as the engine (K capped by the tokens
left), in seconds instead of a bench's minutes on a busy machine. `rows_per_pass` is the mean
verify rows a drafting pass used (1 + its drafts or tree nodes).

Prints one JSON object: `tree_ms_n<N>`, `chain_ms_n<N>` (median ms of a forward over 1 + N rows),
`decode_ms` (one row), and the ratios to a decode step. Trees, chains and the decode step take
turns within each round, so a slow spell of a shared machine lands on all of them alike. The tree
of each size is the best tree (specctl.trees.build_tree) of a random 3-position block: a realistic
bushy shape, whose rows gather their ancestors' keys (verifier.gqa_sdpa_attention).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

NODES = (1, 2, 4, 8, 16, 31)


def tree_verify_costs(model, prefix: int = 200, rounds: int = 9, depth: int = 3) -> dict[str, float]:
    """Median ms per forward kind (see the module doc), the cache cropped back after each."""
    from transformers import DynamicCache

    from specctl.trees import build_tree, verify_rows_mask

    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    cache = DynamicCache(config=model.config)
    times: dict[str, list[float]] = {}
    with torch.inference_mode():
        model(input_ids=torch.randint(0, vocab, (1, prefix), generator=gen), past_key_values=cache)
        trees = {
            n: build_tree(torch.log_softmax(torch.randn(depth, vocab, generator=gen) * 3, -1), n)
            for n in NODES
        }

        def timed(key: str, n: int, **kw) -> None:
            ids = torch.randint(0, vocab, (1, n), generator=gen)
            start = time.perf_counter()
            model(input_ids=ids, past_key_values=cache, use_cache=True, **kw)
            times.setdefault(key, []).append((time.perf_counter() - start) * 1000)
            cache.crop(-n)

        for _ in range(rounds):
            timed("decode_ms", 1)
            for n, tree in trees.items():
                timed(f"chain_ms_n{n}", 1 + n)
                positions = prefix + torch.cat([torch.zeros(1, dtype=torch.long), tree.depths])
                timed(
                    f"tree_ms_n{n}",
                    1 + n,
                    attention_mask=verify_rows_mask(tree.parents, prefix),
                    position_ids=positions[None],
                )
    out = {k: round(statistics.median(v), 2) for k, v in times.items()}
    for n in NODES:
        out[f"tree_vs_decode_n{n}"] = round(out[f"tree_ms_n{n}"] / out["decode_ms"], 3)
        out[f"chain_vs_decode_n{n}"] = round(out[f"chain_ms_n{n}"] / out["decode_ms"], 3)
    return out


def replay_acceptance(
    model, drafter, prompt: list[int], output: list[int], K: int, nodes: int | None, aux_ids
) -> list[tuple[int, int]]:
    """(drafts accepted, drafts verified) per drafting pass when `drafter` (chain when `nodes` is
    None, else trees of `nodes` nodes, made as the drafter's spec says:
    specctl.drafters.api.propose_tree) speculates along plain decoding's `output` after `prompt`,
    as generate() steps."""
    from specctl.drafters import DRAFTERS
    from specctl.drafters.api import propose_tree
    from specctl.trees import greedy_tree_accept
    from specctl.verifier import capture_hidden_states

    seq = torch.tensor(prompt + output)
    aux = capture_hidden_states(model, seq[None], None, aux_ids)[0][0]  # [T, n_aux, H]
    style = DRAFTERS[drafter.algo].tree
    n, end, state, accepted = len(prompt) + 1, len(seq), {}, []
    while n < end:
        k = min(K, end - n - 1)
        if k == 0:
            n += 1
            continue
        if nodes is None:
            drafts, _ = drafter.propose_with_logits(seq[:n], aux[: n - 1], k, state=state)
            a, drafted = int((drafts == seq[n : n + k]).int().cumprod(0).sum()), k
        else:
            tree = propose_tree(drafter, style, seq[:n], aux[: n - 1], k, nodes, state)
            # the verifier's argmax after the root and after each node: plain's next token at its depth
            # (a node off plain's path never extends an accepted path, so any value will do there)
            target = torch.cat([seq[n : n + 1], seq[(n + tree.depths).clamp(max=end - 1)]])
            a, drafted = len(greedy_tree_accept(tree.tokens, tree.parents, target)[0]), tree.num_nodes
        accepted.append((a, drafted))
        n += a + 1
    return accepted


def acceptance_main(args) -> None:
    from specctl.bench.prompts import load_prompts
    from specctl.export import load_drafter
    from specctl.recipe import VerifierSection
    from specctl.verifier import load_verifier

    verifier = load_verifier(VerifierSection(name_or_path=args.verifier, dtype=args.dtype, device="cpu"))
    drafter = load_drafter(args.acceptance, verifier=verifier)[0]
    K = args.k or drafter.export_config().speculative_tokens
    rows = [json.loads(line) for line in Path(args.outputs).read_text().splitlines()]
    plain = {r["prompt_index"]: r["token_ids"] for r in rows if r["method"] == "no-spec"}
    prompts, _ = load_prompts("builtin", verifier.tokenizer, len(plain), 0, split=args.split)
    result = {}
    with torch.inference_mode():
        for nodes in [None, *args.nodes]:
            passes = [
                replay_acceptance(
                    verifier.model, drafter, list(prompts[i].prompt_ids), out, K, nodes, verifier_aux(drafter)
                )
                for i, out in sorted(plain.items())
            ]
            flat = [a for p in passes for a, _ in p]
            rows = [1 + drafted for p in passes for _, drafted in p]
            depth = [sum(a > d for a in flat) / len(flat) for d in range(K)]
            result["chain" if nodes is None else f"tree{nodes}"] = {
                "accepted_length": round(1 + sum(flat) / len(flat), 3),
                "passes": len(flat),
                "rows_per_pass": round(sum(rows) / len(rows), 2),
                "reached_depth": [round(x, 3) for x in depth],
            }
    print(json.dumps({"drafter": str(args.acceptance), "K": K, "split": args.split, **result}))


def verifier_aux(drafter) -> tuple[int, ...]:
    return tuple(drafter.verifier.aux_layer_ids)


def main() -> None:
    from specctl.recipe import VerifierSection
    from specctl.verifier import load_verifier

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verifier", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prefix", type=int, default=200)
    ap.add_argument("--acceptance", help="a drafter export: replay its chain and trees (see the module doc)")
    ap.add_argument("--outputs", help="a bench's outputs.jsonl holding plain decoding's (no-spec) outputs")
    ap.add_argument("--split", default="test")
    ap.add_argument("--k", type=int, default=None)
    ap.add_argument(
        "--nodes", type=lambda t: [int(x) for x in t.split(",")], default=[2, 4, 6, 8, 12, 16, 24, 31]
    )
    args = ap.parse_args()
    if args.acceptance:
        return acceptance_main(args)
    verifier = load_verifier(VerifierSection(name_or_path=args.verifier, dtype=args.dtype, device="cpu"))
    figures = tree_verify_costs(verifier.model, args.prefix)
    print(
        json.dumps(
            {"verifier": args.verifier, "dtype": args.dtype, "threads": torch.get_num_threads(), **figures}
        )
    )


if __name__ == "__main__":
    main()
