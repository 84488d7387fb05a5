"""bench-perf's sequence-length section and gpu-check: keys, memory guard, OOM handling, and the
gpu-check CPU dry run end to end with the packages the GPU machine lacks blocked.

Benchmarks are not tests: nothing here asserts a speed, only that the figures are produced.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check, perf
from specctl.drafters import DRAFTERS

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_address_space_limit_turns_a_too_large_allocation_into_an_error():
    with perf.address_space_limit(64 * 2**20), pytest.raises(RuntimeError, match="allocate"):
        torch.empty(2**30, dtype=torch.uint8)
    assert torch.empty(2**28, dtype=torch.uint8).numel() == 2**28  # lifted on exit


def test_bench_optim_reports_its_figures(tmp_path):
    figures = perf.bench_optim(tmp_path, shapes=((8, 12),))
    assert figures["muon_step_s_torch.8x12"] > 0 and figures["muon_speedup_torch_vs_fp32.8x12"] > 0
    assert 0 <= figures["muon_update_rel_diff_torch_vs_fp32.8x12"] < 0.1  # bf16 vs float32 iteration
    assert figures["lr_max_deviation_torch_schedulers"] < 1e-9
    assert figures["lr_max_deviation_transformers_cosine_with_min_lr"] > 0.01  # LR 0 at step 0


def test_bench_seq_reports_every_algo_and_length(tmp_path):
    figures = perf.bench_seq(
        tmp_path, seq_lens=(32, 64), hidden_size=32, num_layers=1, vocab_size=128, tokens_per_measure=32
    )
    for algo in DRAFTERS:
        for seq_len in (32, 64):
            assert figures[f"train_positions_per_s_seq{seq_len}.{algo}"] > 0
            assert figures[f"train_peak_mem_mb_seq{seq_len}.{algo}"] >= 0
            assert figures[f"train_step_s_seq{seq_len}.{algo}"] > 0
        assert figures[f"train_time_ratio_seq64_vs_32.{algo}"] > 0
        assert figures[f"train_cpu_time_ratio_seq64_vs_32.{algo}"] > 0
        assert figures[f"train_positions_ratio_seq64_vs_32.{algo}"] > 0
    assert all(isinstance(v, int | float) for v in figures.values())  # one flat JSON object


def test_bench_seq_reports_a_step_over_the_memory_limit_instead_of_failing(tmp_path, monkeypatch):
    """The guard's failure at one length is recorded and the run goes on. (Whether a real step
    trips RLIMIT_AS depends on the heap the process already holds, so the guard is simulated
    here; the test above checks that the real guard trips.)"""
    lengths = iter([32, 64] * len(DRAFTERS))

    @contextlib.contextmanager
    def guard(extra_bytes: int):
        if next(lengths) == 64:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 GiB")
        yield

    monkeypatch.setattr(perf, "address_space_limit", guard)
    figures = perf.bench_seq(
        tmp_path,
        seq_lens=(32, 64),
        hidden_size=32,
        num_layers=1,
        vocab_size=128,
        mem_limit_mb=8,
        tokens_per_measure=32,
    )
    for algo in DRAFTERS:
        assert figures[f"train_over_mem_limit_mb_seq64.{algo}"] == 8
        assert f"train_positions_per_s_seq64.{algo}" not in figures
        assert figures[f"train_positions_per_s_seq32.{algo}"] > 0


def test_perf_cli_selects_the_seq_section():
    assert "seq" in perf.BENCHES


def gpu_check_args(argv: list[str]):
    """The namespace main() builds, for calling the plan builders directly."""
    args = argparse.Namespace(
        seq_len=None, batch_size=None, warmup=None, steps=None, compile=False, peak_tflops=989.0
    )
    args.algos = gpu_check.registered_algos()
    for item in argv:
        key, value = item.split("=")
        setattr(args, key, int(value))
    return args


def test_gpu_check_uses_the_published_llama_drafter_sizes():
    plan = gpu_check.gpu_plan(gpu_check_args([]))
    assert plan.verifier["hidden_size"] == 4096 and plan.verifier["vocab_size"] == 128256
    assert (plan.verifier["num_attention_heads"], plan.verifier["num_key_value_heads"]) == (32, 8)
    assert len(plan.verifier["aux_layer_ids"]) == 3 and plan.dtype == torch.bfloat16
    setups = {algo: gpu_check.drafter_setup(algo, plan) for algo in gpu_check.registered_algos()}
    assert setups["eagle3"][0]["num_layers"] == 1 and setups["eagle3"][1] == 32000
    assert setups["peagle"][0]["num_layers"] == 4 and setups["peagle"][0]["num_depths"] == 4
    assert setups["peagle"][1] == 32000
    assert setups["dflash"][0]["num_layers"] == 5 and setups["dflash"][0]["block_size"] == 16
    assert setups["dspark"][0]["block_size"] == 8 and setups["dspark"][0]["markov_rank"] == 256
    assert {s[3] for s in setups.values()} == {128002}  # <|reserved_special_token_0|>
    for algo, (fields, *_rest) in setups.items():
        DRAFTERS[algo].config_cls(**fields)  # valid configs


def test_gpu_check_out_of_memory_retries_shorter_and_one_failure_spares_the_others(monkeypatch):
    plan = gpu_check.dry_plan(gpu_check_args(["seq_len=96"]))
    calls: list[tuple[str, int]] = []

    def fake_train_one(algo, plan, spec, weights, seq_len):
        calls.append((algo, seq_len))
        if algo == "dflash" and seq_len > 48:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80 GiB")
        if algo == "peagle":
            raise ValueError("broken")
        return {"status": "ok", "seq_len": seq_len}

    monkeypatch.setattr(gpu_check, "train_one", fake_train_one)
    rows = gpu_check.train_check(plan, log=lambda msg: None)
    assert rows["dflash"]["status"] == "ok" and rows["dflash"]["seq_len"] == 48
    assert rows["dflash"]["oom_seq_lens"] == [96]
    assert rows["peagle"]["status"] == "error" and "broken" in rows["peagle"]["error"]
    assert rows["eagle3"]["status"] == rows["dspark"]["status"] == "ok"
    assert ("dspark", 96) in calls  # the algorithms after the failures still ran


DRY_RUN = """
import json, sys
for name in ("pydantic", "datasets", "gguf"):  # import of a None entry raises ImportError
    sys.modules[name] = None
import benchmarks.gpu_check as g  # importable without any of them
assert g.main(["--dry-run", "--output", sys.argv[1]]) == 2  # says pydantic is missing, exits
del sys.modules["pydantic"]  # the drafters need it; datasets and gguf stay blocked
assert g.main(["--dry-run", "--output", sys.argv[1]]) == 0
assert sys.modules["datasets"] is None and sys.modules["gguf"] is None
"""


def test_gpu_check_dry_run_end_to_end_without_datasets_or_gguf(tmp_path):
    out = tmp_path / "gpu-check.json"
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(DRY_RUN), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "need pydantic" in result.stderr
    report = json.loads(out.read_text())
    assert report["dry_run"] is True and "6 * trainable_params" in report["mfu_formula"]
    # the padded collect batch and every plan piece ran with the math attention kernel ruled out
    assert report["collect_attention"]["status"] == "ok", report["collect_attention"]
    for algo in gpu_check.registered_algos():
        row = report["train"][algo]
        assert row["status"] == "ok", row
        assert row["positions_per_s"] > 0 and row["trainable_params"] > 0
        assert row["counted_flops_per_step"] > 0
        checked = report["plan"][algo]  # the recipe's piece: the plan's traced peak against the run's
        assert checked["status"] == "ok", checked
        assert 0.75 <= checked["measured_over_predicted"] <= 1.25, checked
        assert report["engine"][algo]["status"] == "ok", report["engine"][algo]
        assert report["engine"][algo]["tokens"] == report["engine"]["verifier"]["max_new_tokens"]
    assert report["engine"]["no_spec"]["tokens_per_s"] > 0
    assert "gpu-check training" in result.stdout  # the rich table


def test_bench_features_compares_both_layouts_of_the_same_data(tmp_path, tiny_verifier_dir):
    """The `features` section collects the same prepared samples twice (bf16, fp8 + top-16) and
    trains each drafter on each store: byte and tau_hat ratios come from those four runs."""
    from test_collect import write_conversations

    from specctl.collect import collect
    from specctl.features import Layout, layout_bytes_per_token
    from specctl.recipe import load_recipe

    chats = write_conversations(tmp_path / "chats.jsonl", n=16)
    overrides = (
        f"verifier.name_or_path={tiny_verifier_dir}",
        f"data.source={chats}",
        "data.max_length=256",
        "features.aux_layer_ids=[1,2,3]",
        "drafter.draft_vocab_size=null",
        "train.max_steps=2",
        "train.warmup_steps=0",
        "train.eval_every=2",
        "train.save_every=2",
        "train.batch_tokens=512",
    )
    made = load_recipe("quickstart.yaml", [*overrides, f"output_dir={tmp_path / 'runs'}", "name=qs"])
    collect(made, progress=False)  # prepares runs/qs/data, as `make demo` does for the real section
    figures = perf.bench_features(tmp_path / "work", made.run_dir, ("eagle3", "dflash"), overrides)

    assert (tmp_path / "work" / "compact" / "features" / "manifest.json").is_file()
    for algo in ("eagle3", "dflash"):
        bf16, compact = figures[f"tau_hat_bf16.{algo}"], figures[f"tau_hat_compact.{algo}"]
        assert bf16 >= 1 and compact >= 1
        assert figures[f"tau_hat_ratio_compact_vs_bf16.{algo}"] == pytest.approx(compact / bf16, abs=1e-3)
    assert figures["tau_hat_ratio_compact_vs_bf16"] == min(
        figures[f"tau_hat_ratio_compact_vs_bf16.{a}"] for a in ("eagle3", "dflash")
    )
    # the measured ratio is the layout's: 3 aux layers of the tiny verifier's hidden 64, vocab 320
    full = layout_bytes_per_token(Layout(), 64, 3, 320)
    small = layout_bytes_per_token(Layout(aux_dtype="fp8", target="topk", topk=16), 64, 3, 320)
    assert figures["feature_bytes_ratio_compact_vs_bf16"] == pytest.approx(small / full, rel=0.05)


def test_bench_features_without_quickstart_data_says_how_to_get_it(tmp_path, capsys):
    assert perf.bench_features(tmp_path, tmp_path / "missing") == {}
    assert "run the quickstart pipeline" in capsys.readouterr().out


def test_data_section_prompts_are_distinct_conversations_to_regenerate(tmp_path):
    """`--only data` runs HF and vLLM on the same 72 prompts, each a user turn and a placeholder
    answer the data stage replaces (the speeds themselves are benchmarks, not tests)."""
    assert "data" in perf.BENCHES
    rows = [json.loads(line) for line in perf._answer_prompts(tmp_path / "p.jsonl").read_text().splitlines()]
    assert len(rows) == 72 == len({r["messages"][0]["content"] for r in rows})
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in rows)


def test_timed_records_every_call_and_puts_the_method_back():
    """engine_propose_ratio_vs_verify times the drafter's propose and the verifier's forward by
    shadowing them for one generation; nn.Module calls go through the shadow, and it is removed."""
    layer = torch.nn.Linear(2, 2)
    with perf.timed(layer, "forward") as seconds:
        layer(torch.zeros(1, 2))
        layer(torch.zeros(1, 2))
    assert len(seconds) == 2 and all(s >= 0 for s in seconds)
    assert "forward" not in vars(layer)
    layer(torch.zeros(1, 2))
    assert len(seconds) == 2


def test_linear_kernel_costs_times_each_kernel_at_each_row_count_and_mv_at_one_row_only():
    costs = perf.linear_kernel_costs([(48, 32), (32, 48)], rows=(1, 4), repeats=2)
    assert set(costs["linear"]) == {1, 4}
    assert set(costs["mv"]) == {1}  # torch.mv takes one row
    # oneDNN's prepacked kernel where this CPU has its bf16 path (not on an AVX2-only one)
    packs_here = perf.prepacked_bf16([torch.zeros(4, 4, dtype=torch.bfloat16)]) is not None
    assert ("prepacked" in costs) == packs_here
    assert all(us > 0 for by_rows in costs.values() for us in by_rows.values())


def test_linear_kernel_costs_refuses_a_kernel_that_computes_another_product(monkeypatch):
    """The comparison is only of kernels computing the same product: a wrong one fails loudly."""
    real_mv = torch.mv
    monkeypatch.setattr(torch, "mv", lambda w, x: real_mv(w, x) + 1.0)
    with pytest.raises(AssertionError):
        perf.linear_kernel_costs([(48, 32)], rows=(1,), repeats=1)
