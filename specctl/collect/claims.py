"""Shard claims: which worker computes which shard of a feature store, safe across machines.

Workers of one store (torchrun ranks, `--shard I/N` processes, on one machine or several sharing
the run directory) coordinate through files only: before computing shard j a worker creates
`claims/shard-J.claim` atomically (`durable.create_once`: of many racing, one wins), recording its
host, pid, start time and a lease expiry; it renews the lease between batches while it works and
removes the claim once the shard is written. Another worker may take a claim over only when its
holder is dead on this host (same host, pid gone) or its lease has expired; a claim of another
host with an unexpired lease is left alone, whatever its pid looks like here, and so are that
writer's temp files (`writer_alive`, which `durable.recover_dir` asks).

A claim saves duplicate work and keeps live writers' files; the store's correctness never rests
on it: a shard's bytes depend only on the plan and are renamed into place whole, so two workers
that both compute one (a holder stalled past its lease, then taken over) write the same file.

Lease expiries are wall-clock times compared across machines, so the hosts' clocks must agree to
well within a lease (NTP keeps them within milliseconds; the default lease is minutes).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from specctl.durable import create_once, host_name, pid_alive, recover_dirs, write_atomic

CLAIMS_DIR = "claims"


@dataclass(frozen=True)
class Claim:
    """One worker's hold on one shard: who (host, pid; token tells two holds of one process
    apart), since when and until when (seconds since the epoch)."""

    shard: int
    host: str
    pid: int
    token: str
    started: float
    expires: float

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Claim | None:
        """The claim in a file's bytes; None for bytes that are not one (torn, or being written)."""
        try:
            return cls(**json.loads(raw))
        except (ValueError, TypeError):
            return None


def claim_stale(
    held: Claim | None, mtime: float, now: float, lease_s: float, host: str, alive: Callable[[int], bool]
) -> bool:
    """Whether a claim file may be taken over: its lease has expired, or its holder ran on this
    `host` and its pid is gone (`alive`). An unreadable file (`held` None: torn, or mid-write
    where the filesystem has no hard links) is stale once it is a lease old by its `mtime`."""
    if held is None:
        return now > mtime + lease_s
    if now > held.expires:
        return True
    return held.host == host and not alive(held.pid)


class ShardClaims:
    """The claims of one feature store (`store/claims/`), as one worker sees and makes them."""

    def __init__(self, store: Path, lease_s: float):
        self.dir = store / CLAIMS_DIR
        self.lease_s = lease_s

    def path(self, j: int) -> Path:
        return self.dir / f"shard-{j:05d}.claim"

    def _new(self, j: int) -> Claim:
        now = time.time()
        return Claim(j, host_name(), os.getpid(), uuid.uuid4().hex, now, now + self.lease_s)

    def _read(self, path: Path) -> tuple[bytes, float] | None:
        """(bytes, mtime) of a claim file, None once it is gone."""
        try:
            with open(path, "rb") as f:
                return f.read(), os.fstat(f.fileno()).st_mtime
        except FileNotFoundError:
            return None

    def _stale(self, raw: bytes, mtime: float) -> bool:
        return claim_stale(Claim.decode(raw), mtime, time.time(), self.lease_s, host_name(), pid_alive)

    def available(self, j: int) -> bool:
        """Whether shard j is unclaimed or its claim may be taken over (a look, not a claim)."""
        found = self._read(self.path(j))
        return found is None or self._stale(*found)

    def take(self, j: int) -> Claim | None:
        """Claim shard j: the new claim, or None when a live worker holds it (or won it just now).

        A free shard goes to whoever creates its claim file (`create_once`). A stale claim goes to
        whoever creates its takeover marker (`.NAME.taken-HASH`, named by the stale claim's bytes,
        so each stale claim is taken over once however many workers judged it stale); the winner
        then writes its claim over the stale one. Markers stay until the store is complete (`clear`):
        a worker that judged the same claim stale late must still find its marker taken.
        """
        self.dir.mkdir(parents=True, exist_ok=True)
        path, mine = self.path(j), self._new(j)
        try:
            if create_once(path, mine.encode(), durable=False):
                return mine
            found = self._read(path)
            if found is None:  # released meanwhile: one more try
                return mine if create_once(path, mine.encode(), durable=False) else None
            if not self._stale(*found):
                return None
            marker = self.dir / f".{path.name}.taken-{hashlib.sha256(found[0]).hexdigest()[:16]}"
            if not create_once(marker, mine.encode(), durable=False):
                return None
            write_atomic(path, mine.encode(), durable=False)
            return mine
        except FileNotFoundError:  # the store finished and its claims were cleared meanwhile
            return None

    def renew(self, claim: Claim) -> Claim | None:
        """Extend the lease: the renewed claim, or None if it is no longer ours (taken over after
        our lease expired: the worker then drops the shard; the taker computes it)."""
        path = self.path(claim.shard)
        found = self._read(path)
        if found is None or found[0] != claim.encode():
            return None
        renewed = replace(claim, expires=time.time() + self.lease_s)
        try:
            write_atomic(path, renewed.encode(), durable=False)
        except FileNotFoundError:  # the claims were cleared: the store is complete without us
            return None
        return renewed

    def release(self, claim: Claim) -> None:
        """Remove our claim (the shard is written, or we stopped); someone else's is left alone."""
        path = self.path(claim.shard)
        found = self._read(path)
        if found is not None and found[0] == claim.encode():
            path.unlink(missing_ok=True)

    def holders(self) -> list[Claim]:
        """Every readable claim in the store now."""
        if not self.dir.is_dir():
            return []
        found = (self._read(p) for p in sorted(self.dir.glob("shard-*.claim")))
        return [c for f in found if f is not None and (c := Claim.decode(f[0])) is not None]

    def writer_alive(self, host: str, pid: int, leftover: Path) -> bool:
        """For `durable.recover_dir`: whether another host's writer that left `leftover` in the store
        may still be writing it. Yes while it holds an unexpired claim here, or while the leftover
        is younger than a lease (files written outside a claim: plan.json, the manifest)."""
        now = time.time()
        try:
            if now - leftover.stat().st_mtime < self.lease_s:
                return True
        except FileNotFoundError:
            return True  # gone already: nothing to remove
        return any(c.host == host and c.pid == pid and c.expires > now for c in self.holders())

    def recover(self) -> None:
        """Remove temp files that killed workers left among the claims (durable.recover_dirs)."""
        if self.dir.is_dir():
            recover_dirs(self.dir, self.writer_alive)

    def clear(self) -> None:
        """Remove every claim file and the directory (the store is complete: claims mean nothing)."""
        if not self.dir.is_dir():
            return
        for p in self.dir.iterdir():
            if p.is_file():
                p.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # a worker claimed meanwhile; it finds the shard done
            self.dir.rmdir()
