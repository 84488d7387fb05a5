"""Small file helpers the stores share: content hashes, durable renames, small files written whole
(`write_atomic`) or created once (`create_once`), and directories replaced whole (checkpoints,
exports), so that a kill at any instant loses nothing.

A file or directory being written sits beside its final name as `.NAME.tmp-HOST-PID` (the swap's
previous directory as `.NAME.old-HOST-PID`). The host is in the name because a run directory may
be on a filesystem several machines share: a pid says nothing about a process on another host,
and two hosts' workers can have the same pid (every container starts its own count). Leftovers
of a dead writer on this host are cleaned up; another host's are kept unless the caller knows
better (`recover_dir`'s `foreign_alive`; the feature store asks its shard claims). Leftovers of
the older `.NAME.tmp-PID` form are read as this host's.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import socket
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from safetensors import SafetensorError

from specctl.errors import ForeignDirError


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


@cache
def host_name() -> str:
    """This machine's name as it goes into temp names and shard claims: the hostname, with anything
    but letters, digits, '.' and '-' made '_' (a temp name stays one plain file name)."""
    return re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "localhost"


def temp_path(path: Path, kind: str = "tmp") -> Path:
    """`.NAME.tmp-HOST-PID` (or `.old-`) beside `path`: this process's private name for it."""
    return path.with_name(f".{path.name}.{kind}-{host_name()}-{os.getpid()}")


def write_atomic(path: Path, data: str | bytes, durable: bool = True) -> None:
    """Write a small file whole: into `.NAME.tmp-HOST-PID` beside it, then rename over `path`.

    A reader, or a kill at any instant, sees the previous file or the new one, never a torn
    write; an exception leaves no temp file. `durable` also flushes the file and its directory
    (a power loss then cannot undo the rename); a report rewritten after every measurement
    can skip that.
    """
    tmp = temp_path(path)
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


# link(2) refused because the filesystem has no hard links (some FUSE and SMB mounts)
_NO_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EMLINK}


def create_once(path: Path, data: str | bytes, durable: bool = True) -> bool:
    """Create `path` holding `data` unless it exists already; True if this call created it.

    Of processes racing for one name, on one host or several sharing a filesystem, exactly one
    gets True. The file appears whole: it is written under this process's temp name and
    hard-linked to `path` (link(2) fails when the name exists, NFS included). Where the filesystem
    has no hard links, an O_EXCL create is the fallback, and a reader may see the file short for
    the instant it is being written. `durable` flushes the file and its directory first (as in
    `write_atomic`); a shard claim skips that, since one lost to a power cut only costs a rerun
    of its shard (2 ms instead of 18 a claim here).
    """
    raw = data.encode() if isinstance(data, str) else data
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in _NO_LINKS:
                raise
            return _create_exclusive(path, raw, durable)
    finally:
        tmp.unlink(missing_ok=True)
    if durable:
        fsync_dir(path.parent)
    return True


def _create_exclusive(path: Path, raw: bytes, durable: bool) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(raw)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    if durable:
        fsync_dir(path.parent)
    return True


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


# .NAME.tmp-HOST-PID: being written; .NAME.old-HOST-PID: the previous NAME, between the two renames
# of a swap; -HOST absent: the older form, read as this host's
_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?:(?P<host>.+)-)?(?P<pid>\d+)$")

# whether another host's writer (host, pid) that left `leftover` still runs; None = assume it does
ForeignAlive = Callable[[str, int, Path], bool] | None


@dataclass(frozen=True)
class Owner:
    """The stage that writes a directory and what proves it did: any one of `marks` (its manifest,
    or a marker it writes first when it creates the directory), or `proves(path)` where a file's
    presence is not proof enough (an export's config.json: a model directory has one too).

    A stage replaces, deletes or writes into a directory only when it is absent, empty, or
    proven its own: a run name or an --output that points at a user's directory must never cost
    the user's files. Directories written by older specctl versions carry the same manifests.
    """

    stage: str  # "the data stage": who refuses, in the message
    marks: tuple[str, ...]  # file names, any one of which proves the directory is the stage's
    fix: str  # what the user does instead: "choose another run name"
    proves: Callable[[Path], bool] | None = None  # replaces the marks' presence as the proof

    def owns(self, path: Path) -> bool:
        if self.proves is not None:
            return self.proves(path)
        return any((path / mark).is_file() for mark in self.marks)

    def check(self, path: Path) -> None:
        """Return when `path` may be replaced: absent, an empty directory (ignoring specctl's own
        leftovers of killed writes, which another worker of the stage may be creating), or one
        this owner proves; else ForeignDirError (one line: what, where, what to do)."""
        if not path.exists() and not path.is_symlink():
            return
        if not path.is_dir():
            raise ForeignDirError(
                f"{path}: exists and is not a directory, {self.stage} will not replace it; {self.fix}"
            )
        if not any(not _LEFTOVER.match(p.name) for p in path.iterdir()) or self.owns(path):
            return
        raise ForeignDirError(
            f"{path}: holds files {self.stage} did not write (no {' or '.join(self.marks)}); "
            f"refusing to replace them: {self.fix}"
        )


def replace_dir(path: Path, write: Callable[[Path], None], owner: Owner) -> None:
    """Write a directory through `write(tmp)` into a hidden sibling, flush it, then swap it in.

    Whatever instant the process dies at (kill -9, power loss), `path` afterwards holds the old
    directory or the new one, whole; the one window where it holds neither (between the two
    renames) leaves the old one as .NAME.old-HOST-PID, which `recover_dir` -- called on every write --
    puts back. An exception from `write` (a full disk) leaves `path` untouched and no temp dir.
    Its files get the umask's modes (give_umask_modes), whatever library wrote them.
    A directory at `path` that `owner` cannot prove its own is refused before anything is written
    (`Owner.check`), and checked again just before the swap.
    """
    recover_dir(path)
    owner.check(path)
    tmp, old = temp_path(path), temp_path(path, "old")
    shutil.rmtree(tmp, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    try:
        write(tmp)
        give_umask_modes(tmp)
        fsync_files(tmp)
        owner.check(path)  # another process may have put something there meanwhile
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


def recover_dir(path: Path, foreign_alive: ForeignAlive = None) -> None:
    """Undo what a killed `replace_dir(path, ...)` left beside `path`: put a previous directory
    caught between the two renames back (or drop it once the new one is in place), and remove
    half-written temp dirs. Leftovers of a live process (another writer) are not touched: on this
    host by its pid; on another host only when `foreign_alive(host, pid, leftover)` says it is
    gone (without it, never: this host cannot see that host's processes)."""
    for leftover in sorted(path.parent.glob(f".{path.name}.*-*")):
        match = _LEFTOVER.match(leftover.name)
        if not match or match["name"] != path.name:
            continue
        if writer_alive(match["host"], int(match["pid"]), leftover, foreign_alive):
            continue
        if match["kind"] == "old" and not path.exists():
            os.rename(leftover, path)
        elif leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
        else:  # a half-written file of an atomic file write
            leftover.unlink(missing_ok=True)
    fsync_dir(path.parent)


def recover_dirs(parent: Path, foreign_alive: ForeignAlive = None) -> None:
    """`recover_dir` for every name in `parent` that has leftovers of a killed `replace_dir` or of a
    killed atomic file write (.NAME.tmp-HOST-PID files of a dead process)."""
    names = {m["name"] for p in parent.glob(".*") if (m := _LEFTOVER.match(p.name))}
    for name in sorted(names):
        recover_dir(parent / name, foreign_alive)


def writer_alive(host: str | None, pid: int, leftover: Path, foreign_alive: ForeignAlive = None) -> bool:
    """Whether the writer named by a leftover's `-HOST-PID` may still be writing it. This host (or
    no host: the older form): its pid runs. Another host: `foreign_alive` decides, and without one
    the answer is yes, since deleting a live writer's file on a shared filesystem breaks its run."""
    if host is None or host == host_name():
        return pid_alive(pid)
    return True if foreign_alive is None else foreign_alive(host, pid, leftover)


def pid_alive(pid: int) -> bool:
    """Whether a process of this host has `pid`; our own pid counts as gone (what it left is from
    an earlier, finished call)."""
    if pid == os.getpid():
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
