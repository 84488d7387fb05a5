"""Run locks: one process at a time writes a given part of a run directory.

Each stage that writes into a run directory holds the lock of what it writes, for as long as it
writes: a drafter's training (`drafters/<algo>`: checkpoints, metrics), an export directory, a
bench output directory, the data stage's `data/`. Two algorithms train in one run at once; two
trainings of one drafter do not (the second would wipe the first's metrics, flip `latest` between
them and prune the other's checkpoints).

The lock is a file beside what it guards, `.NAME.lock`, created atomically (`durable.create_once`:
of racing processes, on one host or several sharing the filesystem, exactly one wins), holding who
holds it: host, pid, the pid's start time (a pid is reused, a (pid, start time) pair is not), the
command line and when it started. It is advisory: only specctl reads it. A lock left by a process
of this host that is gone is stale: the next process takes it over and says so. A holder on another
host cannot be checked from here, so it is reported like a live local one: the stage exits 1 with
one line naming the holder, and the user deletes the file if they know that process is dead.

Not flock(2): a lock on a shared filesystem must name its holder to the user of another machine,
and NFS's byte-range locks vanish or linger with the lock daemon's mood.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from specctl.durable import create_once, host_name, pid_alive
from specctl.errors import SpecctlError
from specctl.progress import note
from specctl.watchdog import start_time

POLL_S = 0.5  # how often a waiting process (the data stage's) looks at the lock again


class RunLocked(SpecctlError):
    """Another process holds the lock of what this stage would write. Exit code 1: nothing is wrong
    with the command; it is the wrong moment."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lock: which process (host, pid, its start time in clock ticks since boot: None
    off Linux), running what, since when (seconds since the epoch); token tells two holds apart."""

    host: str
    pid: int
    pid_start: int | None
    command: str
    started: float
    token: str

    @classmethod
    def me(cls) -> Holder:
        command = shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv else "python"
        pid = os.getpid()
        return cls(host_name(), pid, start_time(pid), command, time.time(), uuid.uuid4().hex)

    def encode(self) -> bytes:
        return (json.dumps(asdict(self)) + "\n").encode()

    @classmethod
    def decode(cls, raw: bytes) -> Holder | None:
        """The holder in a lock file's bytes; None for bytes that are not one."""
        try:
            return cls(**json.loads(raw))
        except (ValueError, TypeError):
            return None

    def describe(self) -> str:
        since = datetime.fromtimestamp(self.started, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        return f"pid {self.pid} on {self.host}, since {since}: {self.command}"


def lock_path(target: Path) -> Path:
    """The lock of directory `target`: `.NAME.lock` beside it (the directory may not exist yet, and
    a stage that swaps `target` whole must not swap its lock away)."""
    return target.parent / f".{target.name}.lock"


_HELD: set[str] = set()  # tokens of the locks this process holds now (threads included)
_CREATING = threading.Lock()


def local_alive(held: Holder) -> bool:
    """Whether the holder, a process of this host, still holds its lock: this process holds it now
    (another thread's block), or the pid exists and, where both start times are known, is the same
    process (not a later one that got the pid)."""
    if held.pid == os.getpid():
        return held.token in _HELD
    if not pid_alive(held.pid):
        return False
    now = start_time(held.pid)
    return held.pid_start is None or now is None or now == held.pid_start


def holder_stale(held: Holder, host: str, alive: Callable[[Holder], bool]) -> bool:
    """Whether a lock may be taken over: its holder ran on this `host` and is gone (`alive`).
    Another host's holder is never judged from here."""
    return held.host == host and not alive(held)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


@contextlib.contextmanager
def _directory_locked(directory: Path) -> Iterator[None]:
    """flock on the directory itself, to serialise takeovers among this host's processes (only they
    ever judge a lock of this host stale); no file is left behind for it."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


def _take_over(path: Path, raw: bytes, held: Holder, say: Callable[[str], None]) -> None:
    """Remove the stale lock `raw` unless it changed meanwhile (another process took it over and
    holds it now); the caller then competes for the lock afresh."""
    with _directory_locked(path.parent):
        if _read(path) == raw:
            path.unlink()
            say(f"{path}: taking over a stale lock of {held.describe()} (that process is gone)")


def _held_by(path: Path, raw: bytes, stage: str) -> str:
    """What the lock at `path` says about its holder, as the start of a one-line message."""
    held = Holder.decode(raw)
    if held is None:
        return f"{path}: unreadable lock of another {stage} (not written by specctl, or damaged)"
    where = "" if held.host == host_name() else " (another host: cannot check it from here)"
    return f"{path}: {stage} already running as {held.describe()}{where}"


def acquire(path: Path, stage: str, say: Callable[[str], None] = note, wait: bool = False) -> Holder:
    """Create the lock at `path` for this process; a stale one is taken over (saying so). A live or
    remote holder: RunLocked naming it, or with `wait` one line naming it, then poll until free."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mine, waiting = Holder.me(), False
    while True:
        with _CREATING:  # create_once's temp name is per process: one thread at a time uses it
            created = create_once(path, mine.encode(), durable=False)
        if created:
            _HELD.add(mine.token)
            return mine
        raw = _read(path)
        if raw is None:  # released meanwhile
            continue
        held = Holder.decode(raw)
        if held is not None and holder_stale(held, host_name(), local_alive):
            _take_over(path, raw, held, say)
            continue
        if not wait:
            raise RunLocked(
                f"{_held_by(path, raw, stage)}; wait for it to finish, or delete the lock if that "
                "process is dead"
            )
        if not waiting:
            say(f"{_held_by(path, raw, stage)}; waiting for it")
            waiting = True
        time.sleep(POLL_S)


def release(path: Path, mine: Holder) -> None:
    """Remove our lock; one that is no longer ours (deleted by hand and retaken) is left alone."""
    if _read(path) == mine.encode():
        path.unlink(missing_ok=True)
    _HELD.discard(mine.token)


@contextlib.contextmanager
def run_lock(
    target: Path, stage: str, say: Callable[[str], None] = note, wait: bool = False
) -> Iterator[Holder]:
    """Hold the lock of directory `target` (`lock_path`) for the block; see `acquire`."""
    path = lock_path(Path(target))
    mine = acquire(path, stage, say, wait)
    try:
        yield mine
    finally:
        release(path, mine)
