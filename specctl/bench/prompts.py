"""Prompt sets for `specctl bench`: the built-in set, named benchmarks, SPEED-Bench, any hub
dataset, and local .json/.jsonl files (ShareGPT, messages-style, prompt or turns rows).

Every source is reduced to chat turns ending in a user turn (plus an optional category),
then rendered with the verifier's chat template and tokenized once, so every method and
every backend decodes from exactly the same token ids.

`--dataset` takes, in this order: `builtin`; a named benchmark (mt-bench, humaneval, gsm8k,
spec-bench); `speed-bench` (NVIDIA's SPEED-Bench, read from its local directory); a local file; a
local directory (SPEED-Bench's); else a hub dataset id, with `--dataset-split`, `--dataset-subset`
and `--dataset-column` (the column holding the prompt text or the turns; by default the row
styles below are recognised).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from specctl.data.chat import render
from specctl.data.sources import normalize_messages, read_json_rows
from specctl.errors import DataError, UsageError, first_line

BUILTIN = "builtin"
# The built-in prompts in two fixed halves (every other row of each category, 6 + 6): choose on the
# first, report on the second. A bench reports `test` unless asked for `dev`.
BUILTIN_SPLITS = ("dev", "test")
BUILTIN_REPORT_SPLIT = "test"
SPEED_BENCH = "speed-bench"
# SPEED-Bench's prompts are assembled from their original sources by NeMo-Skills' prepare script
# (as `vllm bench serve --dataset-name speed_bench` documents): a directory of <subset>.jsonl
SPEED_BENCH_PREPARE = "https://raw.githubusercontent.com/NVIDIA-NeMo/Skills/refs/heads/main/nemo_skills/dataset/speed-bench/prepare.py"
SPEED_BENCH_SUBSETS = (
    "qualitative",
    "throughput_1k",
    "throughput_2k",
    "throughput_8k",
    "throughput_16k",
    "throughput_32k",
)
ROW_STYLES = (
    "`messages` / `conversations` (chat turns, ShareGPT's from/value too), `prompt` (text) or "
    "`turns` (list of user turns)"
)
LOCAL_HINT = "offline, pass --dataset builtin or a local .jsonl/.json file"
SPEC_BENCH_URL = "https://raw.githubusercontent.com/hemingkx/Spec-Bench/main/data/spec_bench/question.jsonl"

Message = dict[str, str]


@dataclass(frozen=True)
class PromptRow:
    """One benchmark question: chat turns ending in a user turn, and its category (if any)."""

    messages: tuple[Message, ...]
    category: str | None = None


@dataclass(frozen=True)
class BenchPrompt:
    """A prompt ready for decoding: the chat template applied and tokenized."""

    prompt_ids: tuple[int, ...]
    category: str | None
    text: str


# ---------------------------------------------------------------- hub benchmarks


def _first_turn(turns: Any) -> str:
    return turns[0] if isinstance(turns, list | tuple) else str(turns)


def _mt_bench(row: dict[str, Any]) -> PromptRow:
    # MT-Bench is two-turn; the second turn needs the model's first answer, so only turn 1 is used.
    return PromptRow(({"role": "user", "content": _first_turn(row["prompt"])},), row.get("category"))


def _humaneval(row: dict[str, Any]) -> PromptRow:
    text = f"Complete the following Python function.\n\n```python\n{row['prompt']}```"
    return PromptRow(({"role": "user", "content": text},), "code")


def _gsm8k(row: dict[str, Any]) -> PromptRow:
    return PromptRow(({"role": "user", "content": row["question"]},), "math")


def _spec_bench(row: dict[str, Any]) -> PromptRow:
    return PromptRow(({"role": "user", "content": _first_turn(row["turns"])},), row.get("category"))


@dataclass(frozen=True)
class HubPromptSet:
    """Where a named benchmark lives and how one of its rows becomes a PromptRow."""

    path: str
    subset: str | None
    split: str
    to_row: Callable[[dict[str, Any]], PromptRow]
    data_files: str | None = None


HUB_PROMPT_SETS: dict[str, HubPromptSet] = {
    "mt-bench": HubPromptSet("HuggingFaceH4/mt_bench_prompts", None, "train", _mt_bench),
    "humaneval": HubPromptSet("openai/openai_humaneval", None, "test", _humaneval),
    "gsm8k": HubPromptSet("openai/gsm8k", "main", "test", _gsm8k),
    # Spec-Bench's questions live in its GitHub repository; `datasets` reads the JSONL by URL.
    "spec-bench": HubPromptSet("json", None, "train", _spec_bench, data_files=SPEC_BENCH_URL),
}
DATASET_CHOICES = ", ".join([BUILTIN, *HUB_PROMPT_SETS, SPEED_BENCH])


def _hub_offline() -> bool:
    return any(
        os.environ.get(k, "").lower() in ("1", "true", "yes")
        for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def load_hub_rows(name: str) -> list[PromptRow]:
    entry = HUB_PROMPT_SETS[name]
    offline_hint = (
        f"--dataset {name} needs the Hugging Face hub; offline, use --dataset builtin or a local .jsonl"
    )
    if _hub_offline():
        raise DataError(f"{offline_hint} (HF_HUB_OFFLINE is set)")
    try:
        import datasets

        ds = datasets.load_dataset(
            entry.path, entry.subset, split=entry.split, data_files=entry.data_files, trust_remote_code=False
        )
    except Exception as e:  # network, auth, missing dataset: all end the same way for the user
        first = first_line(e, 160)
        raise DataError(f"{offline_hint} ({type(e).__name__}: {first})") from None
    try:
        return [entry.to_row(dict(r)) for r in ds]
    except (KeyError, IndexError, TypeError) as e:
        raise DataError(f"--dataset {name}: rows of {entry.path} lack the expected field {e}") from None


def load_hub_dataset(
    name: str, split: str | None, subset: str | None, column: str | None
) -> tuple[list[PromptRow], str]:
    """Any hub dataset by id (what `vllm bench serve --dataset-name hf --dataset-path ID` takes),
    its rows read as a local file's are, or from `column`. Offline (HF_HUB_OFFLINE) `datasets`
    reads its local cache; a dataset that is not there fails naming what to pass instead."""
    split = split or "train"
    try:
        import datasets

        ds = datasets.load_dataset(name, subset, split=split, trust_remote_code=False)  # no hub scripts
    except Exception as e:  # network, auth, unknown dataset, split or subset: one line for the user
        offline = "HF_HUB_OFFLINE is set and it is not in the local cache; " if _hub_offline() else ""
        raise DataError(
            f"--dataset {name}: not available ({offline}{type(e).__name__}: {first_line(e, 160)}); check the "
            f"id, --dataset-split / --dataset-subset, or {LOCAL_HINT} with {ROW_STYLES}"
        ) from None
    where = f"{name}[{split}]"
    rows = [row_from_json(dict(r), f"{where}: row {i + 1}", column) for i, r in enumerate(ds)]
    if not rows:
        raise DataError(f"--dataset {name}: split {split!r} is empty; pick another with --dataset-split")
    return rows, f"{name}[{subset + ':' if subset else ''}{split}]"


def speed_bench_rows(directory: Path | None, split: str | None) -> tuple[list[PromptRow], str]:
    """SPEED-Bench from its local directory (`<subset>.jsonl`, rows of `messages` + `category`, as
    NeMo-Skills' prepare script writes them): `--dataset DIR`, or `--dataset speed-bench` with
    SPEED_BENCH_DIR set. `split` picks the subset (default qualitative: 11 categories)."""
    subset = split or "qualitative"
    env = os.environ.get("SPEED_BENCH_DIR")
    found = directory if directory is not None else Path(env).expanduser() if env else None
    if found is not None and (found / f"{subset}.jsonl").is_file():
        return load_jsonl_rows(found / f"{subset}.jsonl"), f"{SPEED_BENCH}[{subset}]"
    have = [s for s in SPEED_BENCH_SUBSETS if found is not None and (found / f"{s}.jsonl").is_file()]
    if have:
        raise UsageError(f"--dataset-split {subset!r}: {found} holds SPEED-Bench {', '.join(have)}")
    where = str(found) if found is not None else "SPEED_BENCH_DIR is not set"
    raise DataError(
        f"--dataset {SPEED_BENCH}: no local SPEED-Bench data ({where}); its prompts are assembled from their "
        f"sources by NeMo-Skills' script (`curl -LsSf {SPEED_BENCH_PREPARE} | python3 -`): run it, then pass "
        f"--dataset <the directory it writes> or set SPEED_BENCH_DIR; {LOCAL_HINT}"
    )


def is_speed_bench_dir(path: Path) -> bool:
    return path.is_dir() and any((path / f"{s}.jsonl").is_file() for s in SPEED_BENCH_SUBSETS)


# ---------------------------------------------------------------- local files and the built-in set


def _column_row(row: dict[str, Any], where: str, column: str) -> PromptRow:
    """`--dataset-column`: the named column holds the prompt text or the chat turns."""
    if column not in row:
        columns = ", ".join(sorted(map(str, row))[:12])
        raise DataError(f"{where}: no column {column!r} (columns: {columns}); fix --dataset-column")
    value = row[column]
    rest = {"category": row["category"]} if "category" in row else {}
    if isinstance(value, str):
        return row_from_json({"prompt": value, **rest}, where)
    return row_from_json({"messages": value, **rest}, f"{where}: {column}")


def row_from_json(row: dict[str, Any], where: str, column: str | None = None) -> PromptRow:
    """A local row -> PromptRow; `messages`/`conversations` keep the turns up to the last user turn.
    With `column`, that column holds the prompt text or the turns."""
    if column is not None:
        return _column_row(row, where, column)
    category = row.get("category")
    if category is not None and not isinstance(category, str | int):
        raise DataError(f"{where}: category must be text, got {type(category).__name__}")
    category = None if category is None else str(category)
    if row.get("messages") is not None or row.get("conversations") is not None:
        key = "messages" if row.get("messages") is not None else "conversations"
        turns = normalize_messages(row[key], f"{where}: {key}")
        last_user = max((i for i, m in enumerate(turns) if m["role"] == "user"), default=None)
        if last_user is None:
            raise DataError(f"{where}: {key} has no user turn; a prompt must end with what the user asks")
        return PromptRow(tuple(turns[: last_user + 1]), category)
    if isinstance(row.get("prompt"), str):
        return PromptRow(({"role": "user", "content": row["prompt"]},), category)
    if isinstance(row.get("turns"), list) and row["turns"] and isinstance(row["turns"][0], str):
        return PromptRow(({"role": "user", "content": row["turns"][0]},), category)
    raise DataError(f"{where}: row has keys {sorted(row)[:12]}; a prompt row holds {ROW_STYLES}")


def load_jsonl_rows(path: Path, column: str | None = None) -> list[PromptRow]:
    """A .jsonl or .json file (a list of rows: ShareGPT's files are one) as prompt rows."""
    rows = read_json_rows(path)
    out = [row_from_json(r, f"{path}: row {i + 1}", column) for i, r in enumerate(rows)]
    if not out:
        raise DataError(f"{path}: no prompts; add rows with {ROW_STYLES}")
    return out


def builtin_split(split: str | None) -> str:
    """The built-in set's split a bench reads: `test` unless `dev` is asked for (a usage error else)."""
    chosen = split or BUILTIN_REPORT_SPLIT
    if chosen not in BUILTIN_SPLITS:
        raise UsageError(
            f"--dataset-split {chosen!r}: the built-in prompts have the splits {', '.join(BUILTIN_SPLITS)}; "
            f"choose settings on {BUILTIN_SPLITS[0]}, report on {BUILTIN_SPLITS[1]}"
        )
    return chosen


def builtin_rows(split: str | None = None) -> list[PromptRow]:
    """One split of the prompt set shipped with specctl: chat, code and math questions (6 each).

    The two splits never share a prompt: `dev` is what any setting is chosen on (K, thresholds,
    recipe changes), `test` is only reported (`builtin_split`)."""
    folder = resources.files("specctl.bench") / "prompts" / builtin_split(split)
    rows: list[PromptRow] = []
    for f in sorted(folder.iterdir(), key=lambda p: p.name):
        if f.name.endswith(".jsonl"):
            with resources.as_file(f) as path:
                rows.extend(load_jsonl_rows(Path(path)))
    return rows


def _local(dataset: str) -> Path | None:
    try:
        path = Path(dataset).expanduser()
        return path if path.exists() else None
    except (OSError, RuntimeError):  # a name too long for the OS; ~user with no such user
        return None


def load_prompt_rows(
    dataset: str, split: str | None = None, subset: str | None = None, column: str | None = None
) -> tuple[list[PromptRow], str]:
    """All rows of a dataset name, file, directory or hub id, and a description for the report."""
    if dataset == BUILTIN:
        return builtin_rows(split), f"{BUILTIN}[{builtin_split(split)}]"
    if dataset in HUB_PROMPT_SETS:
        return load_hub_rows(dataset), dataset
    if dataset == SPEED_BENCH:
        return speed_bench_rows(None, split)
    path = _local(dataset)
    if path is not None and path.is_file():
        return load_jsonl_rows(path, column), str(path)
    if path is not None and is_speed_bench_dir(path):
        return speed_bench_rows(path, split)
    if path is None and dataset.count("/") == 1 and not dataset.startswith((".", "/", "~")):
        return load_hub_dataset(dataset, split, subset, column)
    what = "a directory without SPEED-Bench data" if path is not None else "no such file"
    raise UsageError(
        f"--dataset {dataset!r}: {what} and not a known set; use one of {DATASET_CHOICES}, a hub "
        f"dataset id (org/name), or a .jsonl/.json file with {ROW_STYLES}"
    )


# ---------------------------------------------------------------- selection and encoding


def select_rows(rows: Sequence[PromptRow], num_prompts: int, seed: int) -> list[PromptRow]:
    """A seeded sample of `num_prompts` rows that spreads evenly over categories.

    Rows are shuffled, grouped by category, then taken round-robin (categories in sorted
    order), so 8 prompts from a 3-category set cover every category instead of whatever
    the shuffle put first.
    """
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    groups: dict[str, list[PromptRow]] = {}
    for i in order:
        groups.setdefault(rows[i].category or "", []).append(rows[i])
    queues = [groups[k] for k in sorted(groups)]
    picked: list[PromptRow] = []
    depth = 0
    while len(picked) < min(num_prompts, len(rows)):
        for q in queues:
            if depth < len(q) and len(picked) < num_prompts:
                picked.append(q[depth])
        depth += 1
    return picked


def encode_prompt(tokenizer: Any, row: PromptRow) -> BenchPrompt:
    """Render with the chat template (generation prompt on) and tokenize without extra specials.

    The template writes its own BOS/role tokens; a tokenizer without a template gets the
    user's text as plain text (a base model), with the tokenizer's usual special tokens.
    """
    if getattr(tokenizer, "chat_template", None):
        text = render(tokenizer, list(row.messages), add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        text = "\n\n".join(m["content"] for m in row.messages)
        ids = tokenizer(text)["input_ids"]
    if not ids:
        raise DataError(f"prompt {text[:40]!r} encodes to no tokens")
    return BenchPrompt(tuple(int(t) for t in ids), row.category, text)


def load_prompts(
    dataset: str,
    tokenizer: Any,
    num_prompts: int,
    seed: int = 0,
    split: str | None = None,
    subset: str | None = None,
    column: str | None = None,
) -> tuple[list[BenchPrompt], str]:
    """Prompts for a benchmark run, tokenized for `tokenizer`, and the dataset's description."""
    rows, description = load_prompt_rows(dataset, split, subset, column)
    return [encode_prompt(tokenizer, r) for r in select_rows(rows, num_prompts, seed)], description
