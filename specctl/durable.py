"""Small file helpers the stores share: content hashes and durable renames."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks (shards and checkpoints are GBs)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make the renames in directory `path` durable: a rename is on disk once its directory is synced."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # nothing to sync (gone, or a platform without directory handles)
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
