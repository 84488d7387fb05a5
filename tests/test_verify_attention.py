"""`bench.verify_attention`: a verify block's rows attended one by one (`exact`, the default,
bit-identical to plain decoding) or in one SDPA call with the block's causal or tree mask
(`batched`, as vLLM on a GPU). The batched block is checked against a brute-force attention, its
greedy outputs against plain decoding in float32, and the setting from recipe and flag to the
engine and the report."""

from __future__ import annotations

import pytest
import torch
from test_engine import NEW, PROMPT, varied_verifier
from test_engine_trees import ranked
from typer.testing import CliRunner

import specctl.verifier as verifier_module
from specctl.engine import generate
from specctl.errors import UsageError
from specctl.trees import build_tree, verify_rows_mask
from specctl.verifier import gqa_sdpa_attention, use_gqa_sdpa, verify_kwargs

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model():
    model = varied_verifier()
    use_gqa_sdpa(model)
    return model


@pytest.fixture(scope="module")
def plain(model) -> list[int]:
    return generate(model, None, PROMPT, NEW).tokens


def brute_force_attention(q, k, v, visible, scale):
    """q [1, Hq, Tq, D], k/v [1, Hkv, Tk, D], visible [Tq, Tk] bool -> [1, Tq, Hq, D]: each row's
    softmax over the keys it sees, in float64, KV head h // (Hq / Hkv) for query head h."""
    Hq, Tq, Hkv = q.shape[1], q.shape[2], k.shape[1]
    out = torch.zeros(1, Tq, Hq, q.shape[3], dtype=torch.float64)
    for h in range(Hq):
        kh, vh = k[0, h // (Hq // Hkv)].double(), v[0, h // (Hq // Hkv)].double()  # [Tk, D]
        for i in range(Tq):
            keys = visible[i].nonzero()[:, 0]
            weights = torch.softmax(q[0, h, i].double() @ kh[keys].T * scale, -1)  # [seen]
            out[0, i, h] = weights @ vh[keys]
    return out


@pytest.mark.parametrize("seed", range(4))
def test_batched_block_is_the_masked_attention_of_each_row(seed):
    """A tree verify (the best tree of a random block, its mask as the engine passes it) and a
    chain verify (no mask: causal after the cache) in one call each, against brute force."""
    g = torch.Generator().manual_seed(seed)
    module, cached = torch.nn.Module(), 30 + 7 * seed
    tree = build_tree(torch.log_softmax(torch.randn(3, 50, generator=g) * 3, -1), [4, 9, 16, 31][seed])
    tree_mask = verify_rows_mask(tree.parents, cached)  # [1, 1, 1+N, cached+1+N]
    rows = tree_mask.shape[2]
    keys = cached + rows
    causal = torch.ones(rows, keys, dtype=torch.bool).tril(cached)  # [rows, keys]
    q = torch.randn(1, 9, rows, 16, generator=g)  # [B, Hq, Tq, D]
    k, v = torch.randn(2, 1, 3, keys, 16, generator=g)  # [B, Hkv, Tk, D] each
    batched = verify_kwargs("batched")
    by_tree, _ = gqa_sdpa_attention(module, q, k, v, tree_mask, scaling=0.25, **batched)
    by_chain, _ = gqa_sdpa_attention(module, q, k, v, None, scaling=0.25, **batched)
    want_tree = brute_force_attention(q, k, v, tree_mask[0, 0], 0.25)
    want_chain = brute_force_attention(q, k, v, causal, 0.25)
    torch.testing.assert_close(by_tree.double(), want_tree, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(by_chain.double(), want_chain, rtol=1e-5, atol=1e-5)
    exact, _ = gqa_sdpa_attention(module, q, k, v, tree_mask, scaling=0.25)  # without: row by row
    torch.testing.assert_close(exact, by_tree, rtol=1e-5, atol=1e-5)


class Spy:
    """Counts the calls of one of specctl.verifier's attention paths, passing them through."""

    def __init__(self, monkeypatch, name: str):
        self.calls, real = 0, getattr(verifier_module, name)

        def spy(*a, **kw):
            self.calls += 1
            return real(*a, **kw)

        monkeypatch.setattr(verifier_module, name, spy)


def test_exact_is_the_default_and_batched_only_where_a_forward_asks(monkeypatch):
    """Batched attention is an argument of the verify forward it changes: without it (the
    default, and every other forward) rows are attended one by one."""
    from specctl.recipe import BenchSection

    assert BenchSection().verify_attention == "exact" and verify_kwargs("exact") == {}
    with pytest.raises(ValueError, match="verify_attention 'batch': choose one of exact, batched"):
        verify_kwargs("batch")  # a typo is not an exact run
    rows, batched = Spy(monkeypatch, "_row_by_row"), Spy(monkeypatch, "_batched_rows")
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)

    def attend(**kw):
        gqa_sdpa_attention(torch.nn.Module(), q, k, v, None, **kw)

    attend()
    attend(**verify_kwargs("batched"))
    attend(**verify_kwargs("exact"))
    assert (rows.calls, batched.calls) == (2, 1)


@pytest.mark.parametrize("nodes", [None, 4, 16, 31])
def test_batched_greedy_equals_plain_decoding_in_float32(model, plain, nodes, monkeypatch):
    """The truth at rank 0-2 of the block (ranked drafter, tests/test_engine_trees.py): chain and
    tree verifies accept drafts, their rows and cache entries decide the output, and it is plain
    decoding's token for token, with every verify block attended in one call."""
    rows, batched = Spy(monkeypatch, "_row_by_row"), Spy(monkeypatch, "_batched_rows")
    drafter = ranked(model, plain, rank=lambda s, i: (s + i) % 3)
    result = generate(
        model, drafter, PROMPT, NEW, num_speculative_tokens=4, tree_nodes=nodes, verify_attention="batched"
    )
    assert result.tokens == plain
    assert result.counters.num_accepted_tokens > 5
    assert rows.calls == 0 and batched.calls >= result.counters.num_drafts  # a call per layer and pass


def test_verify_attention_from_flag_and_recipe_to_the_run(tmp_path, monkeypatch):
    """`--verify-attention` is generated from the schema and checked by it (one line naming the
    flag, exit 2); without the flag the recipe's value stays, and exact is the default."""
    import specctl.bench.run
    from specctl.cli import app
    from specctl.recipe import BenchSection

    seen = []

    def fake_run_bench(recipe, settings, **kw):
        seen.append(settings.verify_attention)
        raise UsageError("stop here")

    monkeypatch.setattr(specctl.bench.run, "run_bench", fake_run_bench)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\nbench:\n  verify_attention: batched\n")
    runner = CliRunner()
    runner.invoke(app, ["bench", "--drafter", "x", "--verify-attention", "batched"])
    runner.invoke(app, ["bench", "--drafter", "x"])
    runner.invoke(app, ["bench", str(recipe), "--drafter", "x"])
    runner.invoke(app, ["bench", str(recipe), "--drafter", "x", "--verify-attention", "exact"])
    assert seen == ["batched", "exact", "batched", "exact"]
    bad = runner.invoke(app, ["bench", "--drafter", "x", "--verify-attention", "fast"])
    assert isinstance(bad.exception, UsageError) and bad.exception.exit_code == 2
    assert str(bad.exception).startswith("--verify-attention 'fast': ")
    assert len(seen) == 4  # refused before the run
    assert BenchSection().verify_attention == "exact"
    help_text = runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "200"}).output
    assert "--verify-attention" in help_text and "exact|batched" in help_text


def test_bench_batched_tree_on_the_embedded_engine(tmp_path, tiny_verifier_dir, monkeypatch):
    """A random DFlash (block 4) with a 4-node tree, batched: float32 outputs equal plain
    decoding's, the verifies ran batched, and report.json says which mode measured the rows."""
    from conftest import bench_with_flags

    from specctl.drafters import DRAFTERS
    from specctl.export import save_drafter
    from specctl.recipe import VerifierSection
    from specctl.verifier import load_verifier, resolve_mask_token_id, verifier_spec, verifier_weights

    verifier = load_verifier(VerifierSection(name_or_path=str(tiny_verifier_dir)))
    spec = verifier_spec(
        verifier, (1, 2, 3), resolve_mask_token_id(verifier.tokenizer, verifier.config, None)
    )
    torch.manual_seed(0)
    cls = DRAFTERS["dflash"]
    drafter = cls.build(
        cls.config_cls(num_layers=1, block_size=4), spec, verifier_weights(verifier), None, "kl"
    )
    export = save_drafter(drafter, tmp_path / "dflash", dtype="float32")
    batched = Spy(monkeypatch, "_batched_rows")
    report = bench_with_flags(
        drafters=[export],
        output=tmp_path / "bench",
        num_prompts=2,
        max_new_tokens=8,
        tree_nodes=[4],
        verify_attention="batched",
        progress=False,
    )
    d = report.to_dict()
    assert report.ok and batched.calls > 0
    assert {r["name"]: r["outputs_match_plain"] for r in d["results"]} == {
        "no-spec": 1.0,
        "dflash": 1.0,
        "dflash-tree4": 1.0,
    }
    assert d["provenance"]["engine"]["verify_attention"] == "batched"
    assert d["settings"]["verify_attention"] == "batched"
    refused = r"--verify-attention batched sets specctl's own engine's attention \(--backend embedded\)"
    with pytest.raises(UsageError, match=refused):
        bench_with_flags(
            drafters=[export],
            output=tmp_path / "v",
            backend="vllm",
            verify_attention="batched",
            progress=False,
        )


def test_tree_cost_benchmark_times_both_modes_and_checks_its_exact_candidate(model):
    """benchmarks/trees.py on a tiny model: every node count in both modes, and the split of an
    exact tree verify's attention, whose shipped rows equal the per-row concatenation's bits."""
    from benchmarks.trees import NODES, capture_tree_attention, row_cost_split, tree_verify_costs

    costs = tree_verify_costs(model, prefix=40, rounds=1)
    for n in NODES:
        for kind in ("tree", "chain", "batched_tree", "batched_chain"):
            assert costs[f"{kind}_ms_n{n}"] > 0
            assert costs[f"{kind}_vs_decode_n{n}"] == pytest.approx(
                costs[f"{kind}_ms_n{n}"] / costs["decode_ms"], abs=2e-3
            )
    calls = capture_tree_attention(model, 40, 31)
    assert len(calls) == model.config.num_hidden_layers and calls[0][0].shape[2] == 32  # root + 31 nodes
    split = row_cost_split(calls, rounds=1)
    assert split["exact_equals_per_row_cat"] == 1
    assert {"exact_ms", "per_row_cat_ms", "runs_ms", "gather_ms", "sdpa_ms", "batched_ms"} <= split.keys()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_exact_tree_rows_attend_each_rows_visible_keys_bit_for_bit(dtype):
    """The exact path's prefix buffer (the cache copied once, each row writing its ancestors
    after it) gives every tree row the bits of a one-row call over its visible keys concatenated
    in order -- what a one-token decode of its path computes -- for trees of 1-31 nodes, and a
    mask that hides cache keys too (its rows share no prefix)."""
    from benchmarks.trees import per_row_cat_rows

    g = torch.Generator().manual_seed(0)
    module = torch.nn.Module()
    for t in range(24):
        cached = 20 + 9 * t
        tree = build_tree(torch.log_softmax(torch.randn(3, 40, generator=g) * 3, -1), 1 + (5 * t) % 31)
        mask = verify_rows_mask(tree.parents, cached)  # [1, 1, 1+N, cached+1+N]
        if t % 6 == 5:
            mask[..., 3 : 3 + t % 4] = False  # holes in the cache: runs that do not start at key 0
        rows, keys = mask.shape[2], mask.shape[3]
        q = (torch.randn(1, 9, rows, 64, generator=g) * [0.5, 2.0, 4.0][t % 3]).to(dtype)  # [B, Hq, Tq, D]
        k, v = torch.randn(2, 1, 3, keys, 64, generator=g).to(dtype)  # [B, Hkv, Tk, D] each
        got, _ = gqa_sdpa_attention(module, q, k, v, mask, scaling=0.125)
        assert torch.equal(got, per_row_cat_rows(q, k, v, mask, 0.125)), t


@pytest.mark.integration
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_on_smollm2_leaves_plain_decoding_only_at_near_ties(dtype, monkeypatch):
    """The real verifier on three built-in prompts, batched verify blocks of chains (K 4) and
    16-node trees from a drafter that puts plain decoding's continuation at rank 0-2. Batched rows
    are not bit-identical to plain decoding's one-row steps, so outputs may part; where they do,
    the divergence analysis (reconstructing the verify batched, as the engine ran it) must find a
    near-tie, never a token the verifier clearly preferred otherwise."""
    from test_engine_trees import RankedBlockDrafter

    from specctl.bench.divergence import find_divergences
    from specctl.bench.prompts import load_prompts
    from specctl.recipe import VerifierSection
    from specctl.verifier import load_verifier

    class PartingRankedDrafter(RankedBlockDrafter):
        """Ranks plain decoding's continuation while the context is plain decoding's; drafts
        anything once the output has parted from it (at a near-tie, or the test fails below)."""

        def propose_with_logits(self, input_ids, aux_hidden_states, num_tokens, state=None):
            if input_ids.tolist() != self.sequence[: input_ids.numel()]:
                logits = torch.zeros(num_tokens, self.vocab_size)
                return logits.argmax(-1), logits
            return super().propose_with_logits(input_ids, aux_hidden_states, num_tokens, state)

    verifier = load_verifier(VerifierSection(name_or_path="smollm2-135m-instruct", dtype=dtype, device="cpu"))
    model = verifier.model
    prompts, _ = load_prompts("builtin", verifier.tokenizer, 8, 0)
    chosen = {i: list(prompts[i].prompt_ids) for i in (1, 3, 5)}
    batched = Spy(monkeypatch, "_batched_rows")
    plain = {i: generate(verifier, None, ids, 32).tokens for i, ids in chosen.items()}
    assert batched.calls == 0  # plain decoding has no verify block
    for nodes in (None, 16):
        outputs, accepted = {}, 0
        for i, ids in chosen.items():
            truth = PartingRankedDrafter(
                ids + plain[i], model.config.vocab_size, rank=lambda s, j: (s + j) % 3
            )
            out = generate(
                verifier,
                truth,
                ids,
                32,
                num_speculative_tokens=4,
                tree_nodes=nodes,
                verify_attention="batched",
            )
            outputs[i], accepted = out.tokens, accepted + out.counters.num_accepted_tokens
        assert accepted > 10 and batched.calls > 0
        found = find_divergences(model, model.dtype, chosen, plain, outputs, k=4, attention="batched")
        assert all(d.near_tie for d in found), found
