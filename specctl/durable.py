"""Small file helpers the stores share: content hashes, durable renames, small files written whole
(`write_atomic`) and directories replaced whole (checkpoints, exports), so that a kill at any
instant loses nothing."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from safetensors import SafetensorError


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


def fsync_files(path: Path) -> None:
    """Flush every file directly inside `path` (before the directory is renamed into place)."""
    for f in path.iterdir():
        with open(f, "rb+") as handle:
            os.fsync(handle.fileno())


def write_atomic(path: Path, data: str | bytes, durable: bool = True) -> None:
    """Write a small file whole: into `.NAME.tmp-PID` beside it, then rename over `path`.

    A reader, or a kill at any instant, sees the previous file or the new one, never a torn
    write; an exception leaves no temp file. `durable` also flushes the file and its directory
    (a power loss then cannot undo the rename); a report rewritten after every measurement
    can skip that.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def umask() -> int:
    """This process's umask, read without changing it where Linux shows it (os.umask can only
    read by setting, which races with files other threads create meanwhile)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def give_umask_modes(path: Path) -> None:
    """Give every file directly inside `path` the mode a new file gets under the umask (0o644
    under the usual 022). safetensors writes its files 0o600, so an export, a checkpoint or the
    data stage would be unreadable to a vLLM server or a teammate running as another user."""
    mode = 0o666 & ~umask()
    for f in path.iterdir():
        if f.is_file() and not f.is_symlink():
            os.chmod(f, mode)


# .NAME.tmp-PID: being written; .NAME.old-PID: the previous NAME, between the two renames of a swap
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)$")


def replace_dir(path: Path, write: Callable[[Path], None]) -> None:
    """Write a directory through `write(tmp)` into a hidden sibling, flush it, then swap it in.

    Whatever instant the process dies at (kill -9, power loss), `path` afterwards holds the old
    directory or the new one, whole; the one window where it holds neither (between the two
    renames) leaves the old one as .NAME.old-PID, which `recover_dir` -- called on every write --
    puts back. An exception from `write` (a full disk) leaves `path` untouched and no temp dir.
    Its files get the umask's modes (give_umask_modes), whatever library wrote them.
    """
    recover_dir(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    try:
        write(tmp)
        give_umask_modes(tmp)
        fsync_files(tmp)
        if path.exists():
            os.rename(path, old)
            try:
                os.rename(tmp, path)
            except OSError:
                os.rename(old, path)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
        fsync_dir(path.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def recover_dir(path: Path) -> None:
    """Undo what a killed `replace_dir(path, ...)` left beside `path`: put a previous directory
    caught between the two renames back (or drop it once the new one is in place), and remove
    half-written temp dirs. Leftovers of a live process (another writer) are not touched."""
    for leftover in sorted(path.parent.glob(f".{path.name}.*-*")):
        match = _LEFTOVER.match(leftover.name)
        if not match or match["name"] != path.name or _alive(int(match["pid"])):
            continue
        if match["kind"] == "old" and not path.exists():
            os.rename(leftover, path)
        elif leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
        else:  # a half-written file of an atomic file write
            leftover.unlink(missing_ok=True)
    fsync_dir(path.parent)


def recover_dirs(parent: Path) -> None:
    """`recover_dir` for every name in `parent` that has leftovers of a killed `replace_dir` or of a
    killed atomic file write (.NAME.tmp-PID files of a dead process)."""
    names = {m["name"] for p in parent.glob(".*") if (m := _LEFTOVER.match(p.name))}
    for name in sorted(names):
        recover_dir(parent / name)


def _alive(pid: int) -> bool:
    if pid == os.getpid():  # our own leftovers are from an earlier, finished call
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def disk_full(error: BaseException | None) -> bool:
    """Whether `error`, or an exception it was raised from or while handling, is a write refused
    for lack of space (ENOSPC, EDQUOT, or EFBIG from RLIMIT_FSIZE)."""
    return disk_full_errno(error) is not None


def disk_full_errno(error: BaseException | None) -> int | None:
    """The errno of `disk_full`'s refused write, None if it is none. torch.save reports one as a
    RuntimeError raised while handling its file's OSError; safetensors as a SafetensorError
    ending `(os error N)`."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in DISK_FULL:
            return error.errno
        if isinstance(error, SafetensorError):
            code = re.search(r"\(os error (\d+)\)", str(error))
            if code and int(code.group(1)) in DISK_FULL:
                return int(code.group(1))
        error = error.__cause__ or error.__context__
    return None
