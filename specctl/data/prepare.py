"""The data stage: source -> conversations -> (input_ids, loss_mask) + token frequencies on disk.

On-disk format of runs/<name>/data/ (see docs/data.md):
  tokens.safetensors      input_ids int32 [total], loss_mask uint8 [total], offsets int64 [N+1]
  token_freq.safetensors  token_freq int64 [V]: counts of loss-masked tokens (draft vocab reduction)
  conversations.jsonl     one line per sample: {"messages": [...]} or {"pretokenized": true, ...}
  manifest.json           format version, fingerprint, counts, tokenizer, source, file sizes

The directory is built under a temporary name, flushed and swapped into place
(`durable.replace_dir`, as checkpoints and exports are), and manifest.json is the last file
written, so a killed run never leaves a directory that reads as complete, and a failing run
leaves the previous complete directory as it was.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from specctl.data import sources
from specctl.data.chat import tokenize_conversations
from specctl.data.generate import GenerationStats, SamplingParams, regenerate, self_generate
from specctl.durable import recover_dir, replace_dir
from specctl.errors import DataError
from specctl.recipe import DataSection

FORMAT_VERSION = 1
FILES = ("tokens.safetensors", "token_freq.safetensors", "conversations.jsonl")
TOKENIZE_CHUNK = 256


@dataclass
class DataSummary:
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    skipped_no_assistant: int
    truncated: int
    skipped_overlong: int
    source: str
    reused: bool = False  # True when a complete directory for the same recipe was found
    generation_tokens_per_s: float | None = None  # None when nothing was generated (or reused)


# ---------------------------------------------------------------- fingerprint


def _tokenizer_fingerprint(tokenizer) -> str:
    """What decides tokenization: the full tokenizer definition and the chat template (not its path)."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(
        json.dumps([tokenizer.chat_template, len(tokenizer), str(tokenizer.special_tokens_map)]).encode()
    )
    return h.hexdigest()


def _source_fingerprint(source: str) -> str:
    """Content hash of a local file (size + mtime listing for a directory); the id for the hub."""
    if sources.is_self_generated(source):
        return source
    path = Path(source).expanduser()
    if path.is_file():
        h = hashlib.sha256()
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()
    if path.is_dir():
        listing = sorted(
            (str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns)
            for p in path.rglob("*")
            if p.is_file()
        )
        return hashlib.sha256(json.dumps(listing).encode()).hexdigest()
    return source


def _relevant_config(cfg: DataSection) -> dict[str, Any]:
    """The DataSection fields that change the output for this source (others do not force a rebuild)."""
    d = cfg.model_dump(mode="json")
    generating = sources.is_self_generated(cfg.source) or cfg.regenerate
    if not sources.is_self_generated(cfg.source):
        d.pop("generate")
    else:
        for k in ("split", "subset", "shuffle", "regenerate"):
            d.pop(k)
    if not generating:
        for k in ("max_new_tokens", "temperature", "top_p", "batch_size"):
            d.pop(k)
    return d


def data_fingerprint(cfg: DataSection, tokenizer) -> str:
    """Hash of everything that determines the bytes of the data directory."""
    payload = {
        "format": FORMAT_VERSION,
        "config": _relevant_config(cfg),
        "source": _source_fingerprint(cfg.source),
        "tokenizer": _tokenizer_fingerprint(tokenizer),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _model_name(model) -> str | None:
    if model is None:
        return None
    return getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None) or "unnamed"


# ---------------------------------------------------------------- reading


def read_manifest(data_dir: Path) -> dict[str, Any] | None:
    """The manifest of a complete data directory, None if absent, unreadable or files are missing."""
    data_dir = Path(data_dir)
    try:
        manifest = json.loads((data_dir / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        return None
    sizes = manifest.get("file_sizes", {})
    for name in FILES:
        p = data_dir / name
        if not p.is_file() or p.stat().st_size != sizes.get(name):
            return None
    return manifest


def _require_manifest(data_dir: Path) -> dict[str, Any]:
    manifest = read_manifest(data_dir)
    if manifest is None:
        raise DataError(
            f"{data_dir}: no complete prepared data (manifest.json missing or files incomplete); "
            "run the data stage again (specctl collect-hidden-states RECIPE prepares it)"
        )
    return manifest


def load_samples(data_dir: Path) -> list[dict[str, torch.Tensor]]:
    """All samples: {"input_ids": [T] int64, "loss_mask": [T] bool}, in stored order."""
    _require_manifest(Path(data_dir))
    t = load_file(str(Path(data_dir) / "tokens.safetensors"))
    ids, mask, offsets = t["input_ids"], t["loss_mask"], t["offsets"].tolist()
    return [
        {"input_ids": ids[a:b].long(), "loss_mask": mask[a:b].bool()}
        for a, b in zip(offsets[:-1], offsets[1:], strict=True)
    ]


def load_token_freq(data_dir: Path, vocab_size: int | None = None) -> torch.Tensor:
    """Counts [V] int64 of each token id over loss-masked tokens; zero-padded up to vocab_size if larger."""
    _require_manifest(Path(data_dir))
    freq = load_file(str(Path(data_dir) / "token_freq.safetensors"))["token_freq"]
    if vocab_size is not None and vocab_size > freq.numel():
        freq = torch.cat([freq, torch.zeros(vocab_size - freq.numel(), dtype=torch.int64)])
    return freq


def _summary_from_manifest(manifest: dict[str, Any]) -> DataSummary:
    fields = {k: manifest["summary"][k] for k in DataSummary.__dataclass_fields__ if k in manifest["summary"]}
    return DataSummary(**{**fields, "reused": True, "generation_tokens_per_s": None})


# ---------------------------------------------------------------- the stage


@contextlib.contextmanager
def _progress_bar(enabled: bool):
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=False) as bar:
        yield bar


@contextlib.contextmanager
def _exclusive(out_dir: Path):
    """Hold an exclusive lock next to out_dir: concurrent collect workers (`--shard I/N`, torchrun
    ranks) build the data once; the others wait, then find it complete and reuse it."""
    import fcntl

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    path = out_dir.parent / f".lock-{out_dir.name}"
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            # Removed while held, so nothing is left beside the data. A waiter that opened the old
            # file may then run beside a newcomer; both re-check the manifest first, and a rebuild
            # writes to a private temp dir swapped in atomically, so at worst work is repeated.
            path.unlink(missing_ok=True)
            fcntl.flock(lock, fcntl.LOCK_UN)


def prepare_data(
    cfg: DataSection, tokenizer, out_dir: Path, model=None, progress: bool = True
) -> DataSummary:
    """Build (or reuse) the tokenized conversations of `cfg` in out_dir.

    `model` (HF causal LM) is needed only to self-generate or regenerate conversations.
    Reuses out_dir without work when it is complete for the same DataSection + tokenizer
    (and, for generated data, the same model when one is passed). Concurrent callers on the
    same out_dir are serialised, so generation runs once.
    """
    out_dir = Path(out_dir)
    with _exclusive(out_dir):
        return _prepare_data(cfg, tokenizer, out_dir, model, progress)


def _prepare_data(cfg: DataSection, tokenizer, out_dir: Path, model, progress: bool) -> DataSummary:
    fingerprint = data_fingerprint(cfg, tokenizer)
    generating = sources.is_self_generated(cfg.source) or cfg.regenerate
    recover_dir(out_dir)  # a run killed mid-swap left the complete old dir beside out_dir: reuse it
    manifest = read_manifest(out_dir)
    if (
        manifest is not None
        and manifest.get("fingerprint") == fingerprint
        and (model is None or not generating or manifest.get("generated_by") == _model_name(model))
    ):
        return _summary_from_manifest(manifest)
    if generating and model is None:
        what = "self-generated data" if sources.is_self_generated(cfg.source) else "data.regenerate"
        raise DataError(
            f"{what} needs the verifier model to write conversations; pass model= to prepare_data"
        )

    vocab_size = len(tokenizer)
    if model is not None:
        vocab_size = max(vocab_size, int(model.get_output_embeddings().weight.shape[0]))
    stats = GenerationStats()
    with _progress_bar(progress) as bar:
        rows, description, counts = _conversations(cfg, tokenizer, model, stats, bar)
        samples = _tokenize(rows, tokenizer, cfg, vocab_size, counts, description, bar)
    if not samples:
        if counts["skipped_no_assistant"] and not counts["skipped_overlong"]:
            raise DataError(
                f"{description}: no row has an assistant turn ({counts['skipped_no_assistant']} skipped); "
                "the loss is on assistant tokens, so pass conversations with assistant replies"
            )
        raise DataError(
            f"{description}: every conversation is longer than data.max_length={cfg.max_length} "
            f"({counts['skipped_overlong']} skipped); raise data.max_length or set data.overlong=truncate"
        )
    summary = _write(out_dir, samples, vocab_size, cfg, tokenizer, model, fingerprint, description, counts)
    summary.generation_tokens_per_s = stats.tokens_per_s if stats.new_tokens else None
    return summary


def _conversations(cfg: DataSection, tokenizer, model, stats: GenerationStats, bar):
    """Normalized rows in output order, the source description, and the skip counters."""
    counts = {"skipped_no_assistant": 0, "truncated": 0, "skipped_overlong": 0}
    answer_params = SamplingParams(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.batch_size, cfg.seed)
    if sources.is_self_generated(cfg.source):
        gen = cfg.generate
        n = min(gen.num_conversations, cfg.max_samples or gen.num_conversations)
        user_params = SamplingParams(
            gen.user_max_new_tokens, gen.user_temperature, gen.user_top_p, gen.batch_size, cfg.seed
        )
        convs = self_generate(model, tokenizer, n, user_params, answer_params, gen.system_prompt, stats, bar)
        return [{"messages": c, "row": i} for i, c in enumerate(convs)], sources.SELF_GENERATED, counts
    src = sources.open_source(cfg.source, cfg.split, cfg.subset)
    rows = []
    order = sources.select_indices(len(src.rows), cfg.max_samples, cfg.shuffle, cfg.seed)
    for i, raw in zip(order, sources.iter_rows(src.rows, order), strict=True):
        row = sources.normalize_row(raw, f"{src.description} row {i}")
        if sources.has_assistant(row):
            rows.append({**row, "row": i})
        else:
            counts["skipped_no_assistant"] += 1
    if not rows:
        raise DataError(
            f"{src.description}: no row has an assistant turn ({counts['skipped_no_assistant']} rows); "
            "the loss is on assistant tokens, so pass conversations with assistant replies"
        )
    if cfg.regenerate:
        text = [r for r in rows if "messages" in r]
        if len(text) != len(rows):
            raise DataError(
                f"{src.description}: data.regenerate needs text conversations but the source has "
                "pre-tokenized rows; set data.regenerate=false or pass `messages`/`conversations` rows"
            )
        new = regenerate(model, tokenizer, [r["messages"] for r in rows], answer_params, stats, bar)
        rows = [{**r, "messages": m} for r, m in zip(rows, new, strict=True)]
    return rows, src.description, counts


def _tokenize(rows, tokenizer, cfg: DataSection, vocab_size: int, counts, description: str, bar):
    """(input_ids, loss_mask, row) per kept row; applies data.overlong and counts what it drops."""
    task = bar.add_task("tokenizing", total=len(rows)) if bar is not None else None
    samples = []
    for lo in range(0, len(rows), TOKENIZE_CHUNK):
        chunk = rows[lo : lo + TOKENIZE_CHUNK]
        text_rows = [r for r in chunk if "messages" in r]
        try:
            encoded = iter(tokenize_conversations(tokenizer, [r["messages"] for r in text_rows]))
        except DataError:
            encoded = iter(_tokenize_one_by_one(tokenizer, text_rows, description))
        for row in chunk:
            if "messages" in row:
                ids, mask = next(encoded)
            else:
                ids, mask = row["input_ids"], row["loss_mask"]
                bad = next((t for t in ids if not 0 <= t < vocab_size), None)
                if bad is not None:
                    raise DataError(
                        f"{description} row {row['row']}: token id {bad} outside the vocabulary "
                        f"[0, {vocab_size}); pre-tokenized rows must use this verifier's tokenizer"
                    )
            if len(ids) > cfg.max_length:
                if cfg.overlong == "skip" or not any(mask[: cfg.max_length]):
                    counts["skipped_overlong"] += 1
                    continue
                ids, mask = ids[: cfg.max_length], mask[: cfg.max_length]
                counts["truncated"] += 1
            if not any(mask):
                counts["skipped_no_assistant"] += 1
                continue
            samples.append((np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8), row))
        if task is not None:
            bar.update(task, advance=len(chunk))
    return samples


def _tokenize_one_by_one(tokenizer, text_rows, description: str):
    """Re-run a failed chunk row by row so the error names the row."""
    for row in text_rows:
        try:
            yield tokenize_conversations(tokenizer, [row["messages"]])[0]
        except DataError as e:
            raise DataError(f"{description} row {row['row']}: {e}") from None


def _write(out_dir: Path, samples, vocab_size: int, cfg, tokenizer, model, fingerprint, description, counts):
    lengths = [len(ids) for ids, _, _ in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    input_ids = torch.from_numpy(np.concatenate([ids for ids, _, _ in samples]))  # [total] int32
    loss_mask = torch.from_numpy(np.concatenate([mask for _, mask, _ in samples]))  # [total] uint8
    token_freq = torch.bincount(input_ids[loss_mask.bool()].long(), minlength=vocab_size)  # [V]
    summary = DataSummary(
        num_samples=len(samples),
        num_tokens=int(offsets[-1]),
        num_loss_tokens=int(loss_mask.sum()),
        source=description,
        **counts,
    )

    def write_files(tmp: Path) -> None:
        save_file(
            {"input_ids": input_ids, "loss_mask": loss_mask, "offsets": offsets},
            str(tmp / "tokens.safetensors"),
        )
        save_file({"token_freq": token_freq.to(torch.int64)}, str(tmp / "token_freq.safetensors"))
        with (tmp / "conversations.jsonl").open("w") as f:
            for ids, _, row in samples:
                line = (
                    {"messages": row["messages"]}
                    if "messages" in row
                    else {"pretokenized": True, "num_tokens": len(ids)}
                )
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
        manifest = {
            "format": FORMAT_VERSION,
            "fingerprint": fingerprint,
            "source": description,
            "tokenizer": tokenizer.name_or_path,
            "vocab_size": vocab_size,
            "generated_by": _model_name(model)
            if (sources.is_self_generated(cfg.source) or cfg.regenerate)
            else None,
            "data": cfg.model_dump(mode="json"),
            "summary": {
                k: v for k, v in asdict(summary).items() if k not in ("reused", "generation_tokens_per_s")
            },
            "file_sizes": {name: (tmp / name).stat().st_size for name in FILES},
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")

    # Flushed, then swapped in whole; a kill between the two renames is undone by the next run
    # (durable.recover_dir), so self-generated conversations are not lost to it.
    replace_dir(out_dir, write_files)
    return summary
