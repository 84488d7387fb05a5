"""Shared fixtures: a tiny byte-level chat tokenizer and tiny random verifiers, built in code."""

from __future__ import annotations

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


def make_tiny_verifier(kind: str = "llama", num_layers: int = 4, vocab_size: int = 320, seed: int = 0):
    """A random Llama/Qwen3 causal LM small enough for unit tests (hidden 64)."""
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
        tie_word_embeddings=False,
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
# quickstart. The SmolLM2 tests (features, serving with vLLM) share one collect.
QUICKSTART_SMALL = [
    "--set",
    "data.max_samples=4",
    "--set",
    "data.max_new_tokens=48",
    "--set",
    "data.generate.user_max_new_tokens=32",
]


def specctl(cwd: Path, *args: str, timeout: int = 1200) -> subprocess.CompletedProcess:
    """`python -m specctl ARGS` in `cwd`, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "specctl", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def collect_quickstart(cwd: Path) -> subprocess.CompletedProcess:
    """The quickstart collect command on the small settings, in `cwd`."""
    recipe = str(ROOT / "recipes" / "quickstart.yaml")
    return specctl(cwd, "collect-hidden-states", recipe, *QUICKSTART_SMALL)


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
    """`make test` runs two xdist workers with `--dist loadfile` (a module's tests share one
    worker, so module fixtures -- trained drafters, vLLM engines -- are built once). The SmolLM2
    module goes first: it is the longest chain of the suite and would otherwise finish last, alone."""
    items.sort(key=lambda item: item.module.__name__ != "test_smollm2")
