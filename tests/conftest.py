"""Shared fixtures: a tiny byte-level chat tokenizer and tiny random verifiers, built in code."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_tiny_tokenizer():
    """A byte-level BPE tokenizer with no merges (259 ids) and a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHATML
    return fast


def make_tiny_verifier(
    kind: str = "llama", num_layers: int = 4, vocab_size: int = 320, seed: int = 0, tied: bool = False
):
    """A random Llama/Qwen3 causal LM small enough for unit tests (hidden 64); `tied`: the LM head
    is the embedding matrix."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=tied,
    )
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    return model.eval()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run faster on one intra-op thread: thousands of small ops, where thread
    hand-offs (OpenMP spinning on a loaded 2-core machine) cost more than the matmuls.
    Modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_verifier_dir(tmp_path_factory) -> Path:
    """A saved HF directory (model + tokenizer) that `load_verifier` can open like any local model."""
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_verifier().save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return path


# ---------------------------------------------------------------- the real SmolLM2 verifier

ROOT = Path(__file__).resolve().parents[1]

# 4 self-generated conversations with short greedy answers: minutes on 2 cores, not the 64 of the
# quickstart. The SmolLM2 tests (features, serving with vLLM) share one collect. Written by HF
# generate, the data the serving checks were calibrated on (a drafter trained on vLLM's own bf16
# answers reached acceptance 2.84 instead of ~1.9); test_generate.py runs the vLLM data path.
QUICKSTART_SMALL = [
    "--set",
    "data.engine=hf",
    "--set",
    "data.max_samples=4",
    "--set",
    "data.max_new_tokens=48",
    "--set",
    "data.generate.user_max_new_tokens=32",
]


# A plain progress line (specctl.progress.LogProgress: stderr is not a terminal) and a stage's plan
# or estimate note: what stderr holds beside a one-line error.
PROGRESS_LINE = re.compile(r"^\[\d\d:\d\d:\d\d\] |^(data|collect): ")


def error_lines(stderr: str) -> list[str]:
    """stderr without progress lines and plan notes: a known failure leaves exactly one line."""
    return [line for line in stderr.strip().splitlines() if line.strip() and not PROGRESS_LINE.match(line)]


def specctl(
    cwd: Path, *args: str, timeout: int = 1200, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python -m specctl ARGS` in `cwd`, output captured (`env`: added to this process's)."""
    return subprocess.run(
        [sys.executable, "-m", "specctl", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def collect_quickstart(cwd: Path) -> subprocess.CompletedProcess:
    """The quickstart collect command on the small settings, in `cwd`."""
    recipe = str(ROOT / "recipes" / "quickstart.yaml")
    return specctl(cwd, "collect-hidden-states", recipe, *QUICKSTART_SMALL)


# Drafters served by vLLM in the SmolLM2 tests: small enough to memorise 3-4 short conversations
# in under a minute per drafter on 2 cores. 4 short conversations use a few hundred distinct
# tokens: a 2048-token draft vocabulary keeps all of them (vLLM still maps through d2t) at a
# quarter of the LM head's cost (measured: the two SmolLM2 modules 11.7 min, from about 13).
# 60 steps at lr 5e-3 instead of 120 at 3e-3 (54-74 s per drafter instead of 97-134 s, AVX2,
# one thread): vLLM's acceptance 3.22 / 2.08 / 2.30 (eagle3 / peagle / dflash), every output
# equal to plain decoding.
SERVE_TRAIN = [
    "--set",
    "drafter.draft_vocab_size=2048",
    "--set",
    "train.val_fraction=0",
    "--set",
    "train.max_steps=60",
    "--set",
    "train.warmup_steps=10",
    "--set",
    "train.lr=5e-3",
    "--set",
    "train.save_every=60",
    "--set",
    "train.log_every=20",
]


def train_and_export(cwd: Path, *algos: str, steps: dict[str, int] | None = None) -> dict[str, Path]:
    """Train each of `algos` on the quickstart features in `cwd` (`steps` overrides the step
    budget of some), then export the run; returns each algorithm's export directory."""
    recipe = str(ROOT / "recipes" / "quickstart.yaml")
    for algo in algos:
        fewer = ["--set", f"train.max_steps={steps[algo]}"] if steps and algo in steps else []
        # the data settings the features were collected with: train checks the store's origin
        done = specctl(cwd, "train", recipe, "--algo", algo, *QUICKSTART_SMALL, *SERVE_TRAIN, *fewer)
        assert done.returncode == 0, done.stderr[-3000:]
    done = specctl(cwd, "export", "runs/quickstart", "--dtype", "fp32", "--check")
    assert done.returncode == 0, done.stderr[-3000:]
    return {algo: cwd / "runs" / "quickstart" / "drafters" / algo / "export" for algo in algos}


def assert_vllm_serves(cwd: Path, exports: dict[str, Path], out: Path) -> None:
    """vLLM's offline engine, through `specctl bench`, decodes the quickstart conversations' prompts
    greedily with each exported drafter and without one: outputs must equal plain decoding, the
    counters must add up, and the acceptance must show the drafter is fed the hidden states it was
    trained on (near 1.0 means nothing is accepted: a wrong layer index or a dropped tensor)."""
    convs = cwd / "runs" / "quickstart" / "data" / "conversations.jsonl"
    prompts = out.with_suffix(".prompts.jsonl")
    with convs.open() as src, prompts.open("w") as dst:
        for line in src:
            messages = json.loads(line)["messages"]
            dst.write(json.dumps({"messages": [m for m in messages if m["role"] != "assistant"]}) + "\n")
    args = [f"--drafter={path}" for path in exports.values()]
    flags = ["--backend", "vllm-offline", "--dataset", str(prompts), "--max-new-tokens", "48"]
    # float32, as the embedded engine: in bf16 (vLLM's CPU default) a K+1-token verify rounds
    # differently from one-token decoding, and on an AMX CPU a near-tie flipped prompt 3 at token
    # 20 (3/4 equal, docs/benchmarking.md "Lossless check"); equality is only promised in float32
    flags += ["--vllm-arg=--dtype=float32"]
    # one pass: this checks outputs and counters, not speed (bench.repeats' default of 3 for a run
    # this short would triple the decode for no check)
    flags += ["--repeats", "1"]
    # vLLM's engine inside the bench's worker, not in two processes below it: this checks numerics,
    # not process layout (test_kill.py and test_bench_vllm.py start vLLM as the bench does), and each
    # of the four engines starts without two more vLLM imports (measured: the bench 233 -> 139 s,
    # alone; the same outputs and acceptance)
    in_process = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = specctl(
        cwd, "bench", *args, *flags, "--temperature", "0", "--output", str(out), timeout=1800, env=in_process
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    results = {r["algo"]: r for r in report["results"]}
    assert set(results) == {"none", *exports}
    for algo in exports:
        r = results[algo]
        assert r["outputs_match_plain"] == 1.0, (algo, r["outputs_match_plain"])
        assert r["num_drafts"] > 0, algo
        assert r["outputs_compared"] == 4 == r["num_prompts"], algo
        assert r["num_draft_tokens"] <= r["num_speculative_tokens"] * r["num_drafts"], algo
        assert sum(r["per_position_acceptance"]) * r["num_drafts"] == pytest.approx(r["num_accepted_tokens"])
        # measured 3.22 / 2.08 / 2.30 (eagle3 / peagle / dflash; SERVE_TRAIN's 60 steps)
        assert r["acceptance_length"] > 1.5, (algo, r["acceptance_length"], r["per_position_acceptance"])


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory) -> Path:
    """Features of 4 self-generated SmolLM2 conversations; returns the working directory
    (the run is `runs/quickstart` inside it)."""
    cwd = tmp_path_factory.mktemp("quickstart")
    result = collect_quickstart(cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "complete" in result.stdout
    return cwd


# ---------------------------------------------------------------- parallel runs (pytest-xdist)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`make test` runs two xdist workers with `--dist loadfile --no-loadscope-reorder`: a module's
    tests share one worker (module fixtures -- trained drafters, vLLM engines -- are built once),
    and modules are handed out in this order, each to the first worker that runs short. Longest
    first keeps both busy to the end: the SmolLM2 modules (test_smollm2_serving.py is the suite's
    longest chain: three drafters trained, four vLLM engines), then the modules with the most
    `slow` tests (each starts vLLM or trains: 25-150 s on 2 cores), then the rest in file order,
    to fill in. Measured: with the slow modules in file order, a 75 s one ran last, alone."""
    slow: dict[str, int] = {}
    for item in items:
        name = item.module.__name__
        slow[name] = slow.get(name, 0) + (item.get_closest_marker("slow") is not None)

    def order(item: pytest.Item) -> tuple[bool, int]:
        name = item.module.__name__
        return not name.startswith("test_smollm2"), -slow[name]

    items.sort(key=order)


def bench_with_flags(recipe=None, **kw):
    """run_bench as `specctl bench` calls it: the bench-section fields among `kw` (num_prompts=3,
    backend="vllm", ...) go over the recipe's section as its flags do (settings.settings_from_flags:
    the same checks and messages), the rest are run options (drafters, concurrency levels, ...)."""
    from specctl.bench.run import default_recipe, run_bench
    from specctl.bench.settings import settings_from_flags
    from specctl.recipe import BenchSection

    flags = {k: kw.pop(k) for k in list(kw) if k in BenchSection.model_fields and k != "concurrency"}
    recipe = default_recipe(recipe, kw.get("drafters", ()), kw.get("baseline"), flags.get("base_url"))
    base = recipe.bench if recipe is not None else BenchSection()
    return run_bench(recipe, settings_from_flags(base, flags), **kw)


def plan_with_flags(drafters, output, verifier=None, **flags):
    """bench.run.plan_run as `specctl bench` calls it with `flags` on the command line and no
    recipe, concurrency, baseline, ngram, K sweep or requirement."""
    from specctl.bench.run import plan_run
    from specctl.bench.settings import bench_settings

    settings = bench_settings(None, **flags)[0]
    return plan_run(None, settings, None, drafters, None, None, False, [], verifier, output, print)
