"""Generated conversations, appended to disk as they finish: what a killed or grown run reuses.

runs/<name>/data.journal/<generation fingerprint, 16 hex>.jsonl
  line 1     {"journal": 1, "fingerprint": ..., "config": {what decides the conversations}}
  then       {"key": K, "messages": [...], "new_tokens": N}   one per finished conversation
          or {"key": K, "skipped": "empty user turn" | "overlong"}

Key K is the conversation's identity: its index for self-generated data, its source row for
regenerated data. The data stage generates only keys the journal lacks, so a rerun after a kill
(or with more conversations asked for) keeps every finished conversation byte for byte and never
writes one twice. Lines are flushed as each batch of conversations finishes, so a kill -9 loses
only the requests in flight (the flushed lines are the kernel's); they are fsynced at most once a
second, so a power loss costs at most that second. A torn last line (killed mid-write) is cut off
when the journal is opened again.

The file is named by the generation fingerprint: a recipe change that changes the conversations
(verifier, chat template, sampling, source...) starts another journal, and a one-line message
names what changed; the old journal stays (switching back reuses it) until deleted.
The journal is kept after the data directory is complete: regrowing or rebuilding the data
(data.max_samples, data.overlong) then costs no generation.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import IO, Any

from specctl.durable import fsync_dir
from specctl.errors import DataError
from specctl.recipe import config_diff
from specctl.redact import redact_tree

JOURNAL_VERSION = 1
SYNC_EVERY_S = 1.0


def _read(path: Path) -> tuple[dict[str, Any] | None, list[dict[str, Any]], int]:
    """(header, records, bytes of whole lines): a last line without its newline is not counted."""
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1  # whole lines only: a kill mid-write leaves a torn tail
    header, records = None, []
    for n, line in enumerate(data[:end].split(b"\n")[:-1], 1):
        try:
            obj = json.loads(line)
        except ValueError:
            raise DataError(
                f"{path}:{n}: damaged journal line (not JSON); delete the file to generate its "
                "conversations again"
            ) from None
        if n == 1:
            header = obj
        else:
            records.append(obj)
    return header, records, end


class Journal:
    """An open journal: `records` (key -> line) of the finished conversations, `append` for more."""

    def __init__(self, path: Path, records: dict[int, dict[str, Any]], file: IO[bytes]):
        self.path, self.records, self._file = path, records, file
        self._synced = time.monotonic()

    @classmethod
    def open(cls, directory: Path, fingerprint: str, config: dict[str, Any]) -> tuple[Journal, str | None]:
        """The journal of `fingerprint` in `directory` (created if new), and a one-line message when
        conversations of another recipe are there and are not reused."""
        config = redact_tree(config)  # written in the header: no credential of a source URL
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{fingerprint[:16]}.jsonl"
        records: dict[int, dict[str, Any]] = {}
        end = 0
        if path.is_file():
            header, lines, end = _read(path)
            if header is not None and header.get("fingerprint") != fingerprint:
                raise DataError(f"{path}: journal of another recipe under this name; delete the file")
            for r in lines:
                records.setdefault(int(r["key"]), r)  # the first line of a key wins
        message = None if records else _other_journals(directory, path, config)
        file = open(path, "r+b" if path.is_file() else "wb")  # noqa: SIM115 (held open to append)
        file.truncate(end)  # drop a torn tail
        file.seek(end)
        if end == 0:
            header = {"journal": JOURNAL_VERSION, "fingerprint": fingerprint, "config": config}
            file.write((json.dumps(header, sort_keys=True) + "\n").encode())
            file.flush()
            os.fsync(file.fileno())
            fsync_dir(directory)
        return cls(path, records, file), message

    def append(self, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        self._file.write(b"".join((json.dumps(r, ensure_ascii=False) + "\n").encode() for r in records))
        self._file.flush()
        for r in records:
            self.records.setdefault(int(r["key"]), r)
        if time.monotonic() - self._synced >= SYNC_EVERY_S:
            os.fsync(self._file.fileno())
            self._synced = time.monotonic()

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _other_journals(directory: Path, mine: Path, config: dict[str, Any]) -> str | None:
    """Why the newest other journal in `directory` is not reused, or None when there is none."""
    others = sorted(
        (p for p in directory.glob("*.jsonl") if p != mine), key=lambda p: p.stat().st_mtime, reverse=True
    )
    for other in others:
        try:
            header, lines, _ = _read(other)
        except (OSError, DataError):
            continue
        if header is None or not lines:
            continue
        return (
            f"data: not reusing the {len(lines):,} conversations in {other}: written for another recipe "
            f"({config_diff(header.get('config', {}), config)}); they stay there (delete the file to "
            "reclaim the space)"
        )
    return None
