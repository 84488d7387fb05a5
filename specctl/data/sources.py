"""Where conversations come from: local .json/.jsonl, `datasets` (hub ids, local dataset dirs).

Rows are normalized to one of two shapes the rest of the stage understands:
  {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}
  {"input_ids": [int, ...], "loss_mask": [0/1, ...]}          (pre-tokenized)
Accepted input styles: UltraChat (`messages` with role/content), ShareGPT (`conversations`
with from/value, roles human/gpt/system), and pre-tokenized rows.
"""

from __future__ import annotations

import json
import numbers
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specctl.errors import DataError, MissingDataError, first_line

SELF_GENERATED = "self-generated"
ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
}
STYLES = (
    "`messages` (role/content), `conversations` (from/value: human/gpt/system), or `input_ids` + `loss_mask`"
)
DATASETS_SUFFIXES = {".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
OFFLINE_HINT = "pass a local .json/.jsonl file or `self-generated` as data.source"


@dataclass
class Source:
    """The raw rows of a source plus a short description for logs and the manifest."""

    rows: Sequence[dict[str, Any]]  # a list, or a `datasets.Dataset` (indexable, len())
    description: str


def is_self_generated(source: str) -> bool:
    return source == SELF_GENERATED


def _looks_like_path(source: str) -> bool:
    return Path(source).suffix.lower() in {".json", ".jsonl", *DATASETS_SUFFIXES} or source.startswith(
        ("/", "./", "../", "~")
    )


def local_path(source: str) -> Path | None:
    """The local file/dir a source names, None for a hub id; DataError for a missing local file."""
    try:
        path = Path(source).expanduser()
        exists = path.exists()
    except (OSError, RuntimeError):  # a name too long for the OS; `~user` with no such user
        path, exists = Path(source), False
    if exists:
        return path
    if _looks_like_path(source):
        raise MissingDataError(  # a recipe value naming nothing: exit 2, like any bad input
            f"data.source={source!r}: file not found (cwd {Path.cwd()}); check the path, "
            "or use a hub dataset id or `self-generated`"
        )
    return None


def open_source(source: str, split: str = "train", subset: str | None = None) -> Source:
    """Raw rows of a local file, a local dataset directory or a hub dataset."""
    path = local_path(source)
    if path is not None and path.is_file() and path.suffix.lower() not in DATASETS_SUFFIXES:
        rows = read_json_rows(path)
        desc = str(path)
    else:
        rows = _load_with_datasets(source, path, split, subset)
        desc = source if path is not None else f"{source}[{subset + ':' if subset else ''}{split}]"
    if len(rows) == 0:
        raise DataError(
            f"data.source={source!r}: the dataset is empty; point data.source at rows of {STYLES}"
        )
    return Source(rows, desc)


# ---------------------------------------------------------------- local JSON / JSONL


def read_json_rows(path: Path) -> list[dict[str, Any]]:
    """Rows of a .json (a list of objects) or .jsonl (one object per line) file.

    A file is tried as one JSON document first, then line by line, so a JSONL file named
    .json works too; the error names the line that fails.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {e.start}); pass a .json or .jsonl file") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or type(e).__name__})") from None
    if not text.strip():
        raise DataError(f"{path}: the file is empty; add rows of {STYLES}")
    try:
        whole = json.loads(text)
    except json.JSONDecodeError as whole_err:
        return _read_jsonl(path, text, whole_err)
    except RecursionError:
        raise DataError(f"{path}: JSON nested too deeply; rows are objects of turns or token ids") from None
    if isinstance(whole, list):
        bad = next((i for i, r in enumerate(whole) if not isinstance(r, dict)), None)
        if bad is not None:
            raise DataError(
                f"{path}: item {bad} is a {type(whole[bad]).__name__}; a .json file is a list of "
                f"objects with {STYLES}"
            )
        return whole
    if isinstance(whole, dict):
        lists = [v for v in whole.values() if isinstance(v, list) and v and isinstance(v[0], dict)]
        if len(lists) == 1 and not any(k in whole for k in ("messages", "conversations", "input_ids")):
            return lists[0]  # {"data": [...]}
        return [whole]  # a one-line JSONL file
    raise DataError(f"{path}: top-level JSON {type(whole).__name__}; expected a list of rows with {STYLES}")


def _read_jsonl(path: Path, text: str, whole_err: json.JSONDecodeError) -> list[dict[str, Any]]:
    rows = []
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.strip())
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except RecursionError:
            raise DataError(f"{path}:{n}: JSON nested too deeply; each line is one row object") from None
        except json.JSONDecodeError as e:
            if n - 1 == first and path.suffix.lower() != ".jsonl":
                # A multi-line JSON document with a syntax error: report its position.
                raise DataError(
                    f"{path}:{whole_err.lineno}:{whole_err.colno}: not valid JSON ({whole_err.msg}); "
                    "fix the file (a .json list of rows, or one JSON object per line in a .jsonl)"
                ) from None
            raise DataError(
                f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno}); each line of a .jsonl "
                "file is one JSON object"
            ) from None
        if not isinstance(obj, dict):
            raise DataError(
                f"{path}:{n}: a JSON {type(obj).__name__}; each line must be one object with {STYLES}"
            )
        rows.append(obj)
    return rows


# ---------------------------------------------------------------- datasets (hub or local dirs)


def _load_with_datasets(source: str, path: Path | None, split: str, subset: str | None):
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"data.source={source!r}: reading datasets needs the `datasets` package; "
            f"`pip install datasets`, or {OFFLINE_HINT}"
        ) from None
    try:
        if path is not None and path.is_file():
            return datasets.load_dataset(
                DATASETS_SUFFIXES[path.suffix.lower()],
                data_files=str(path),
                split="train",
                trust_remote_code=False,  # never a dataset's own loading script (datasets < 3 ran them)
            )
        if path is not None and (
            (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()
        ):
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DataError(
                        f"data.source={source!r}: no split {split!r}; set data.split to one of {sorted(ds)}"
                    )
                ds = ds[split]
            return ds
        name = str(path) if path is not None else source
        return datasets.load_dataset(name, subset, split=split, trust_remote_code=False)
    except DataError:
        raise
    except Exception as e:
        raise _datasets_error(source, path, split, subset, e) from None


def _datasets_error(
    source: str, path: Path | None, split: str, subset: str | None, e: Exception
) -> DataError:
    name = type(e).__name__
    msg = first_line(e) if str(e).strip() else name
    if "split" in msg.lower() and ("unknown" in msg.lower() or "should be one of" in msg.lower()):
        return DataError(f"data.source={source!r}: {msg}; set data.split accordingly")
    if "config" in msg.lower() and subset is not None:
        return DataError(f"data.source={source!r}: {msg}; set data.subset to an existing configuration")
    if path is not None:
        return DataError(
            f"data.source={source!r}: `datasets` cannot read this local file/directory ({name}: {msg}); "
            "pass a .json/.jsonl file, a `save_to_disk` directory, or a directory of data files"
        )
    return DataError(
        f"data.source={source!r}: unknown hub dataset or hub unreachable ({name}: {msg}); check the id "
        f"and network, or offline {OFFLINE_HINT}"
    )


# ---------------------------------------------------------------- rows


def select_indices(n: int, max_samples: int | None, shuffle: bool, seed: int) -> list[int]:
    """Row order after shuffling (seeded) and capping at max_samples."""
    order = list(range(n))
    if shuffle:
        random.Random(seed).shuffle(order)
    return order[:max_samples] if max_samples is not None else order


def normalize_row(row: dict[str, Any], where: str) -> dict[str, Any]:
    """One raw row -> {"messages": [...]} or {"input_ids", "loss_mask"}; DataError if malformed."""
    for key in ("messages", "conversations"):
        if row.get(key) is not None:
            return {"messages": normalize_messages(row[key], f"{where}: {key}")}
    if "input_ids" in row and "loss_mask" in row:
        return _normalize_pretokenized(row, where)
    raise DataError(f"{where}: row has keys {sorted(row)[:12]}, in no known style; accepted styles: {STYLES}")


def normalize_messages(turns: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(turns, list):
        raise DataError(f"{where}: expected a list of turns, got {type(turns).__name__}")
    out = []
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DataError(f"{where}[{j}]: a turn is an object with role/content or from/value")
        raw_role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        role = ROLE_ALIASES.get(str(raw_role).lower()) if raw_role is not None else None
        if role is None:
            raise DataError(
                f"{where}[{j}]: bad role {raw_role!r} (keys {sorted(turn)}); accepted roles: "
                "system, user/human, assistant/gpt"
            )
        if not isinstance(content, str):
            raise DataError(f"{where}[{j}]: content must be text, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    return out


def _normalize_pretokenized(row: dict[str, Any], where: str) -> dict[str, Any]:
    ids, mask = row["input_ids"], row["loss_mask"]
    for name, value in (("input_ids", ids), ("loss_mask", mask)):
        if not isinstance(value, list | tuple) and not hasattr(value, "tolist"):
            raise DataError(f"{where}: {name} must be a list, got {type(value).__name__}")
    ids = ids.tolist() if hasattr(ids, "tolist") else ids  # numpy arrays from `datasets`
    mask = mask.tolist() if hasattr(mask, "tolist") else mask
    if not isinstance(ids, list | tuple) or not isinstance(mask, list | tuple):  # 0-d arrays
        raise DataError(f"{where}: input_ids and loss_mask must be lists of equal length")
    if len(ids) != len(mask):
        raise DataError(
            f"{where}: input_ids has {len(ids)} tokens but loss_mask {len(mask)}; they must match"
        )
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
        raise DataError(f"{where}: input_ids must be integers")
    if not all(m in (0, 1) for m in mask):
        raise DataError(f"{where}: loss_mask must hold 0/1 (or booleans)")
    return {"input_ids": [int(t) for t in ids], "loss_mask": [bool(m) for m in mask]}


def has_assistant(row: dict[str, Any]) -> bool:
    if "messages" in row:
        return any(m["role"] == "assistant" for m in row["messages"])
    return any(row["loss_mask"])


def iter_rows(rows: Sequence[dict[str, Any]], order: Sequence[int]):
    """Rows in `order`; a `datasets.Dataset` is selected once instead of indexed row by row."""
    if hasattr(rows, "select"):
        yield from rows.select(list(order))
    else:
        for i in order:
            yield rows[i]
