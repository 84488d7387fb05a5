"""Divergences from plain decoding: the finder, the margins, the near-tie limit, `--require
lossless`, and the verifier's attention making a verify row equal plain decoding's, bit for bit."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_tiny_verifier

from specctl.bench.divergence import (
    NEAR_TIE_ULPS,
    Divergence,
    classify,
    find_divergences,
    first_difference,
    margin_logits,
    near_tie_limit,
    summary_line,
    top2_margin,
)
from specctl.bench.report import check_requirements, parse_requirement
from specctl.verifier import gqa_sdpa_attention

pytestmark = pytest.mark.usefixtures("one_thread")


def test_first_difference_equals_brute_force():
    rng = random.Random(0)
    for _ in range(2000):
        a = [rng.randrange(3) for _ in range(rng.randrange(6))]
        b = [rng.randrange(3) for _ in range(rng.randrange(6))]
        if rng.random() < 0.3:
            b = a[: rng.randrange(len(a) + 1)]
        brute = next((j for j in range(max(len(a), len(b))) if a[j : j + 1] != b[j : j + 1]), None)
        assert first_difference(a, b) == brute, (a, b)


def test_top2_margin_and_near_tie_limit():
    assert top2_margin(torch.tensor([1.0, 5.0, 4.25, -2.0])) == 0.75
    assert top2_margin(torch.tensor([3.0, 3.0])) == 0.0
    # bf16 keeps 8 significant bits: spacing 2^-7 * 16 = 0.125 at logits in [16, 32)
    assert near_tie_limit(20.0, torch.bfloat16) == NEAR_TIE_ULPS * 0.125
    assert near_tie_limit(-40.0, torch.bfloat16) == NEAR_TIE_ULPS * 0.25
    assert near_tie_limit(20.0, torch.float32) == NEAR_TIE_ULPS * 2.0**-19


def test_classify_uses_the_plain_forwards_margin_between_the_two_tokens():
    one = torch.tensor([20.0, 19.5, 10.0, 18.0])  # plain chose 0; a method that chose 1 or 3
    block = torch.tensor([19.5, 20.0, 10.0, 18.0])
    tie = classify(4, 1, [5, 0], [5, 1], one, block, torch.bfloat16)
    assert (tie.prompt_index, tie.token_index, tie.plain_token, tie.method_token) == (4, 1, 0, 1)
    assert tie.pair_margin == 0.5 and tie.plain_margin == 0.5 and tie.verify_margin == 0.5
    assert tie.limit == 1.0 and tie.near_tie
    wide = classify(4, 1, [5, 0], [5, 3], one, block, torch.bfloat16)
    assert wide.pair_margin == 2.0 and not wide.near_tie
    ended = classify(0, 1, [5, 0], [5], one, block, torch.bfloat16)
    assert ended.method_token is None and ended.pair_margin is None and not ended.near_tie


def test_margin_logits_equal_a_full_forward_on_a_tiny_model():
    """The one-token and block logits at j are the verifier's next-token logits after
    prompt + tokens[:j] (float32: both equal a cache-free forward to rounding)."""
    model = make_tiny_verifier(seed=3)
    prompt, tokens = [5, 9, 33, 7], [11, 12, 13, 14, 15, 16]
    for j in (0, 1, 4):
        one, block = margin_logits(model, prompt, tokens, j, tokens[j : j + 3])
        with torch.no_grad():
            ref = model(torch.tensor([prompt + tokens[:j]])).logits[0, -1]
        torch.testing.assert_close(one, ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(block, ref, atol=1e-4, rtol=1e-4)


def test_find_divergences_finds_only_differing_outputs():
    model = make_tiny_verifier(seed=4)
    prompts = {0: [5, 6, 7], 1: [8, 9]}
    plain = {0: [10, 11, 12, 13], 1: [20, 21, 22]}
    outputs = {0: [10, 11, 99, 13], 1: [20, 21, 22]}
    found = find_divergences(model, torch.float32, prompts, plain, outputs, k=2)
    assert [(d.prompt_index, d.token_index, d.plain_token, d.method_token) for d in found] == [(0, 2, 12, 99)]
    with torch.no_grad():
        ref = model(torch.tensor([[5, 6, 7, 10, 11]])).logits[0, -1]
    assert found[0].pair_margin == pytest.approx(float(ref[12] - ref[99]), abs=1e-4)


def _divergence(near_tie: bool, prompt: int = 3) -> Divergence:
    return Divergence(prompt, 9, 1, 2, 0.1, 0.1, 0.1 if near_tie else 3.0, 1.0, near_tie)


def test_summary_line_counts_near_ties_and_names_the_others():
    assert summary_line({"dflash": []}) == "no output differs from plain decoding"
    line = summary_line({"dflash": [_divergence(True)], "eagle3": [_divergence(True, 5)]})
    assert line == "2 of 2 divergences from plain decoding at a near-tie (margin < 1)"
    line = summary_line({"dflash": [_divergence(True), _divergence(False, 6)]})
    assert line.startswith("1 of 2 divergences") and "dflash prompt 6 token 9 (margin 3)" in line


def _report(divergences: list[dict] | None) -> dict:
    unexplained = None if divergences is None else sum(not d["near_tie"] for d in divergences)
    results = [
        {"name": "no-spec", "algo": "none", "divergences": None, "unexplained_divergences": None},
        {
            "name": "dflash",
            "algo": "dflash",
            "divergences": divergences,
            "unexplained_divergences": unexplained,
        },
    ]
    return {"results": results, "categories": []}


def test_require_lossless():
    req = parse_requirement("lossless")
    assert check_requirements(_report([]), [req]) == []
    assert check_requirements(_report([_divergence(True).to_dict()]), [req]) == []
    (line,) = check_requirements(_report([_divergence(False, 6).to_dict()]), [req])
    assert line.startswith("lossless: dflash left plain decoding at prompt 6 token 9, margin 3.000")
    (line,) = check_requirements(_report(None), [req])
    assert "not compared" in line
    # the count is a figure of its own too
    assert check_requirements(
        _report([_divergence(False).to_dict()]), [parse_requirement("dflash.unexplained_divergences==0")]
    )


def test_a_verify_block_attends_each_row_as_a_one_token_step():
    """Each row of a block of new rows on a KV cache (a verify) equals, bit for bit, the attention
    of a one-token decode step at its position. torch's CPU SDPA kernel alone gave another
    rounding for about 9% of such bf16 rows here (random SmolLM2-shaped q/k/v)."""
    module = torch.nn.Module()
    g = torch.Generator().manual_seed(0)
    for t in range(120):
        Tk, Tq, scale = 40 + t % 80, 2 + t % 4, [0.5, 2.0, 4.0][t % 3]
        q = (torch.randn(1, 9, Tq, 64, generator=g) * scale).bfloat16()  # [B, Hq, Tq, D]
        k, v = torch.randn(2, 1, 3, Tk, 64, generator=g).bfloat16()  # [B, Hkv, Tk, D] each
        mask = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq)[None, None]  # causal after the cache
        block, _ = gqa_sdpa_attention(module, q, k, v, mask, scaling=0.125)  # [B, Tq, Hq, D]
        for i in range(Tq):
            seen = Tk - Tq + i + 1
            one, _ = gqa_sdpa_attention(
                module, q[:, :, i : i + 1], k[:, :, :seen], v[:, :, :seen], None, scaling=0.125
            )
            assert torch.equal(block[:, i : i + 1], one), (t, i)


class RandomDrafts:
    """The worst drafter: uniformly random tokens, so nearly every emitted token is row 0 of a
    K+1-row verify rather than a one-token forward (what a trained drafter's rejections do)."""

    def __init__(self, vocab_size: int, k: int):
        self.vocab_size, self.k = vocab_size, k
        self.generator = torch.Generator().manual_seed(0)
        self.verifier = type("Spec", (), {"aux_layer_ids": (2,)})()

    def export_config(self):
        return type("Export", (), {"speculative_tokens": self.k})()

    def propose_with_logits(self, ids, aux, k, state):
        """Random drafts; no logits (the engine drafts greedily from the drafts alone)."""
        return torch.randint(0, self.vocab_size, (k,), generator=self.generator), None


@pytest.mark.integration
def test_embedded_bf16_speculation_equals_plain_decoding_on_smollm2():
    """SmolLM2-135M-Instruct in bf16, three builtin prompts that left plain decoding at tokens 8-18
    before verify rows were computed as one-token steps (= plain 3/8 on 8 prompts, now 8/8):
    every divergence must be a near-tie, and on a CPU with AMX, whose bf16 F.linear gives a row
    the same bits at 1 and K+1 rows (measured), there must be none."""
    from specctl.bench.prompts import load_prompts
    from specctl.data.generate import stop_token_ids
    from specctl.devices import cpu_bf16_kind
    from specctl.engine import generate
    from specctl.recipe import VerifierSection
    from specctl.verifier import load_verifier

    verifier = load_verifier(
        VerifierSection(name_or_path="smollm2-135m-instruct", dtype="bfloat16", device="cpu")
    )
    prompts, _ = load_prompts("builtin", verifier.tokenizer, 8, 0)
    stop = list(stop_token_ids(verifier.tokenizer, verifier.model))
    chosen = {i: list(prompts[i].prompt_ids) for i in (2, 4, 6)}
    plain, spec = {}, {}
    for i, ids in chosen.items():
        plain[i] = generate(verifier, None, ids, 32, eos_token_ids=stop).tokens
        drafter = RandomDrafts(verifier.config.vocab_size, 3)
        spec[i] = generate(verifier, drafter, ids, 32, eos_token_ids=stop).tokens
    found = find_divergences(verifier.model, torch.bfloat16, chosen, plain, spec, k=3)
    assert all(d.near_tie for d in found), found
    if cpu_bf16_kind() == "amx":
        assert spec == plain


def test_bench_reports_divergences_and_require_lossless_fails_on_a_wide_one(tmp_path, tiny_verifier_dir):
    """The embedded bench, plain decoding real, the drafter's run plain decoding with one token
    replaced (prompt 1, token 3): report.json names that divergence with its margins, it is no
    near-tie in float32, and --require lossless fails on it and on nothing else."""
    from types import SimpleNamespace

    from conftest import bench_with_flags
    from test_bench import _write_drafter

    from specctl.engine import generate
    from specctl.recipe import recipe_from_dict

    def generate_fn(verifier, drafter, prompt_ids, max_new_tokens, **kw):
        kw.pop("num_speculative_tokens", None)
        result = generate(verifier, None, prompt_ids, max_new_tokens, **kw)
        if drafter is not None and drafter.wrong and kw["seed"] == 1:  # prompt index 1 (seed 0 + index)
            result.tokens[3] = (result.tokens[3] + 1) % verifier.config.vocab_size
        return result

    _write_drafter(tmp_path / "dflash", "dflash", 4, str(tiny_verifier_dir))
    for wrong in (False, True):
        recipe = recipe_from_dict(
            {
                "name": "t",
                "output_dir": str(tmp_path / "runs"),
                "verifier": {"name_or_path": str(tiny_verifier_dir), "dtype": "float32"},
                "bench": {"num_prompts": 3, "max_new_tokens": 6},
            }
        )
        report = bench_with_flags(
            recipe,
            drafters=[tmp_path / "dflash"],
            requires=["lossless"],
            generate_fn=generate_fn,
            load_drafter_fn=lambda path, verifier, wrong=wrong: (SimpleNamespace(wrong=wrong), {}),
            progress=False,
            output=tmp_path / f"bench-{wrong}",
        )
        d = report.to_dict()
        plain, dflash = d["results"]
        assert plain["divergences"] is None
        if not wrong:
            assert dflash["divergences"] == [] and dflash["unexplained_divergences"] == 0
            assert not report.failures and d["divergence_summary"] == "no output differs from plain decoding"
            continue
        (div,) = dflash["divergences"]
        assert (div["prompt_index"], div["token_index"]) == (1, 3) and not div["near_tie"]
        assert div["pair_margin"] > div["limit"] > 0 and div["plain_margin"] > 0
        assert dflash["unexplained_divergences"] == 1
        assert report.failures[0].startswith("lossless: dflash left plain decoding at prompt 1 token 3")
        assert d["divergence_summary"].startswith("0 of 1 divergences from plain decoding at a near-tie")
        assert "divergences: 0 of 1" in (tmp_path / f"bench-{wrong}" / "report.md").read_text()
