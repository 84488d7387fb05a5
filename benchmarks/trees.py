"""The verify cost curve of draft trees: what one KV-cached verifier forward over a tree of N nodes
costs, against a chain verify of the same number of rows and against one decode step.

Usage: python -m benchmarks.trees [--verifier smollm2-135m-instruct] [--dtype bfloat16,float32] [--prefix 200]
       python -m benchmarks.trees --acceptance DRAFTER_DIR --outputs OUTPUTS.jsonl [--split test]

`--acceptance`: the accepted length per verifier pass of a drafter's chain and of its trees of
each size (a parallel drafter's from its block, EAGLE-3's by its top-k expansion), replayed
exactly along plain decoding's greedy outputs (a bench's outputs.jsonl, method no-spec): greedy
tree verification emits plain decoding's tokens (tests/test_engine_trees.py), so a pass accepts
the longest tree path that matches them, and no verifier pass is needed beyond one forward per
prompt for the drafter's features. The same trajectory as the engine (K capped by the tokens
left), in seconds instead of a bench's minutes on a busy machine. `rows_per_pass` is the mean
verify rows a drafting pass used (1 + its drafts or tree nodes).

Prints one JSON object per dtype: `tree_ms_n<N>`, `chain_ms_n<N>` (median ms of a forward over
1 + N rows, verify attention `exact`: row by row), `batched_tree_ms_n<N>`, `batched_chain_ms_n<N>`
(the block in one SDPA call, `bench.verify_attention: batched`), `decode_ms` (one row), and each
one's ratio to a decode step (`..._vs_decode_n<N>`). Trees, chains in both modes and the decode
step take turns within each round, so a slow spell of a shared machine lands on all of them
alike. The tree of each size is the best tree (specctl.trees.build_tree) of a random 3-position
block: a realistic bushy shape, whose exact rows gather their ancestors' keys
(verifier.gqa_sdpa_attention). `split_n31`: where an exact 31-node tree's attention time goes
(`row_cost_split`). The matmul kernel is the bench's `auto` (float32: oneDNN prepacked).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

NODES = (1, 2, 4, 8, 16, 31)
MODES = ("exact", "batched")  # bench.verify_attention: rows one by one, or the block in one call


def tree_verify_costs(model, prefix: int = 200, rounds: int = 9, depth: int = 3) -> dict[str, float]:
    """Median ms per forward kind (see the module doc), the cache cropped back after each; every
    kind in both verify attention modes, the batched ones prefixed `batched_`."""
    from transformers import DynamicCache

    from specctl.trees import build_tree, verify_rows_mask
    from specctl.verifier import verify_kwargs

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
                positions = prefix + torch.cat([torch.zeros(1, dtype=torch.long), tree.depths])
                mask = verify_rows_mask(tree.parents, prefix)
                for mode in MODES:
                    name = "" if mode == "exact" else f"{mode}_"
                    attend = verify_kwargs(mode)
                    timed(f"{name}chain_ms_n{n}", 1 + n, **attend)
                    timed(
                        f"{name}tree_ms_n{n}",
                        1 + n,
                        attention_mask=mask,
                        position_ids=positions[None],
                        **attend,
                    )
    out = {k: round(statistics.median(v), 2) for k, v in times.items()}
    for key in [k for k in out if k != "decode_ms"]:
        out[key.replace("_ms_", "_vs_decode_")] = round(out[key] / out["decode_ms"], 3)
    return out


def capture_tree_attention(model, prefix: int, nodes: int, depth: int = 3) -> list[tuple]:
    """The (query, key, value, mask, scaling) of every layer's attention in one exact verify of a
    `nodes`-node tree on a `prefix`-token cache: real shapes and values for `row_cost_split`."""
    from transformers import DynamicCache

    import specctl.verifier as verifier_module
    from specctl.trees import build_tree, verify_rows_mask

    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    tree = build_tree(torch.log_softmax(torch.randn(depth, vocab, generator=gen) * 3, -1), nodes)
    cache, calls = DynamicCache(config=model.config), []
    real = verifier_module._row_by_row

    def record(query, key, value, mask, scaling):
        calls.append((query, key, value, mask, scaling))
        return real(query, key, value, mask, scaling)

    with torch.inference_mode():
        model(input_ids=torch.randint(0, vocab, (1, prefix), generator=gen), past_key_values=cache)
        verifier_module._row_by_row = record
        try:
            model(
                input_ids=torch.randint(0, vocab, (1, 1 + nodes), generator=gen),
                past_key_values=cache,
                attention_mask=verify_rows_mask(tree.parents, prefix),
                position_ids=(prefix + torch.cat([torch.zeros(1, dtype=torch.long), tree.depths]))[None],
            )
        finally:
            verifier_module._row_by_row = real
    return calls


def gather_runs(calls: list[tuple], runs: list) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per layer, per row: the (keys, values) of its visible runs, as `_row_by_row` gathers them."""

    def cat(x: torch.Tensor, row: list[tuple[int, int]]) -> torch.Tensor:
        return torch.cat([x[:, :, a:b] for a, b in row], 2)

    return [[(cat(k, row), cat(v, row)) for row in r] for (_, k, v, _, _), r in zip(calls, runs, strict=True)]


def per_row_cat_rows(query, key, value, mask, scaling) -> torch.Tensor:
    """The exact tree attention as it was before the prefix buffer (`verifier._row_by_row`): each
    row's visible runs concatenated into a tensor of its own, the cache copied once a row. The
    reference the shipped one must equal bit for bit. [1, Hq, Tq, D] -> [1, Tq, Hq, D]."""
    from specctl.verifier import _sdpa, _visible_runs

    rows, keys = query.shape[2], key.shape[2]
    out = []
    for i, row in enumerate(_visible_runs(mask, rows, keys)):
        k = torch.cat([key[:, :, a:b] for a, b in row], 2)  # [1, kvh, visible, D]
        v = torch.cat([value[:, :, a:b] for a, b in row], 2)
        out.append(_sdpa(query[:, :, i : i + 1], k, v, None, scaling))
    return torch.cat(out, 2).transpose(1, 2).contiguous()


def row_cost_split(calls: list[tuple], rounds: int = 9) -> dict[str, float]:
    """Where an exact tree verify's attention time goes, summed over the layers of `calls`
    (capture_tree_attention), median ms of `rounds`: the shipped row-by-row attention
    (`exact_ms`: the cache copied once a layer into a buffer, each row writing its ancestors
    after it), the same by a per-row torch.cat of each row's runs (`per_row_cat_ms`, as before)
    and that one's parts -- finding each row's visible runs (`runs_ms`, one host copy per layer),
    the per-row concatenation (`gather_ms`) and the one-row SDPA calls on keys already gathered
    (`sdpa_ms`) -- against the block in one call (`batched_ms`)."""
    from specctl.verifier import _batched_rows, _row_by_row, _sdpa, _visible_runs

    def find_runs():
        return [_visible_runs(m, q.shape[2], k.shape[2]) for q, k, _, m, _ in calls]

    runs = find_runs()
    gathered = gather_runs(calls, runs)

    def gather_only():  # each row's keys and values dropped at once, as row by row frees them
        for (_, k, v, _, _), r in zip(calls, runs, strict=True):
            for row in r:
                torch.cat([k[:, :, a:b] for a, b in row], 2), torch.cat([v[:, :, a:b] for a, b in row], 2)

    def one_row_calls():
        for (q, _, _, _, scaling), layer in zip(calls, gathered, strict=True):
            for i, (k, v) in enumerate(layer):
                _sdpa(q[:, :, i : i + 1], k, v, None, scaling)

    parts = {
        "exact_ms": lambda: [_row_by_row(*c) for c in calls],
        "runs_ms": find_runs,
        "gather_ms": gather_only,
        "sdpa_ms": one_row_calls,
        "batched_ms": lambda: [_batched_rows(*c) for c in calls],
        "per_row_cat_ms": lambda: [per_row_cat_rows(*c) for c in calls],
    }
    times: dict[str, list[float]] = {}
    with torch.inference_mode():
        for _ in range(rounds):
            for key, work in parts.items():  # the parts take turns within a round
                start = time.perf_counter()
                work()
                times.setdefault(key, []).append((time.perf_counter() - start) * 1000)
    out: dict[str, float] = {k: round(statistics.median(v), 3) for k, v in times.items()}
    out["layers"], out["rows"] = len(calls), calls[0][0].shape[2]
    with torch.inference_mode():  # 1: the shipped rows are the per-row concatenation's, bit for bit
        out["exact_equals_per_row_cat"] = int(
            all(torch.equal(per_row_cat_rows(*c), _row_by_row(*c)) for c in calls)
        )
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
    from specctl.kernels import apply_kernel
    from specctl.recipe import VerifierSection
    from specctl.verifier import load_verifier

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verifier", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default=None, help="cost curve: a comma list (default bfloat16,float32)")
    ap.add_argument("--prefix", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--acceptance", help="a drafter export: replay its chain and trees (see the module doc)")
    ap.add_argument("--outputs", help="a bench's outputs.jsonl holding plain decoding's (no-spec) outputs")
    ap.add_argument("--split", default="test")
    ap.add_argument("--k", type=int, default=None)
    ap.add_argument(
        "--nodes", type=lambda t: [int(x) for x in t.split(",")], default=[2, 4, 6, 8, 12, 16, 24, 31]
    )
    args = ap.parse_args()
    if args.acceptance:
        args.dtype = args.dtype or "bfloat16"
        return acceptance_main(args)
    for dtype in (args.dtype or "bfloat16,float32").split(","):
        verifier = load_verifier(VerifierSection(name_or_path=args.verifier, dtype=dtype, device="cpu"))
        kernel = apply_kernel(verifier.model, "auto")  # as the bench's engine runs it
        figures = tree_verify_costs(verifier.model, args.prefix, args.rounds)
        split = row_cost_split(capture_tree_attention(verifier.model, args.prefix, 31), args.rounds)
        threads = torch.get_num_threads()
        head = {"verifier": args.verifier, "dtype": dtype, "linear_kernel": kernel, "threads": threads}
        print(json.dumps({**head, **figures, "split_n31": split}), flush=True)


if __name__ == "__main__":
    main()
