"""Shard claims and host-aware leftovers: who may take a shard over, who may delete whose temp
files, and that racing workers (separate processes, as on separate hosts) get one winner each."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from specctl.collect.capture import work_order
from specctl.collect.claims import Claim, ShardClaims, claim_stale
from specctl.durable import create_once, host_name, recover_dirs, temp_path

DEAD = 2**30 - 1  # above any Linux pid_max: no process has it
OTHER = "other-node.cluster"  # a second machine sharing the run directory
LIVE = os.getppid()  # the test runner's parent: alive on this host


def write_claim(claims: ShardClaims, j: int, host: str, pid: int, expires_in: float) -> Claim:
    now = time.time()
    claim = Claim(j, host, pid, f"token-{host}-{pid}", now - 10, now + expires_in)
    claims.dir.mkdir(parents=True, exist_ok=True)
    claims.path(j).write_bytes(claim.encode())
    return claim


def leftovers(claims: ShardClaims, j: int) -> int:
    """The takeover markers beside shard j's claim file; fails on anything else there."""
    names = {p.name for p in claims.dir.iterdir()} - {claims.path(j).name}
    assert all(n.startswith(f".{claims.path(j).name}.taken-") for n in names), names
    return len(names)


def age(path: Path, seconds: float) -> Path:
    """Make `path` look last written `seconds` ago."""
    then = time.time() - seconds
    os.utime(path, (then, then))
    return path


# ---------------------------------------------------------------- the rule


def test_claim_stale_is_expiry_or_a_dead_holder_on_this_host():
    """Every combination against the rule written out case by case."""
    now, lease = 1000.0, 60.0
    for expired, same_host, alive, readable, old_file in itertools.product([False, True], repeat=5):
        held = Claim(0, "here" if same_host else "there", 7, "t", 0.0, now - 1 if expired else now + 1)
        mtime = now - (lease + 1 if old_file else 1)
        got = claim_stale(held if readable else None, mtime, now, lease, "here", lambda pid, a=alive: a)
        if not readable:
            want = old_file  # a torn file: judged by its age alone
        elif expired:
            want = True
        else:
            want = same_host and not alive  # another host's pid means nothing here
        assert got == want, (expired, same_host, alive, readable, old_file)


def test_work_order_takes_own_shards_first_then_the_next_ranks():
    for n, world in itertools.product(range(0, 13), range(1, 5)):
        for rank in range(world):
            order = work_order(n, rank, world)
            assert sorted(order) == list(range(n))
            owners = [j % world for j in order]
            expected = sorted(owners, key=lambda r: (r - rank) % world)
            assert owners == expected  # own, then rank+1's, rank+2's, ...
            for r in range(world):  # each worker's shards in ascending order
                mine = [j for j in order if j % world == r]
                assert mine == sorted(mine)
            assert work_order(n, rank, world, whole=False) == [j for j in range(n) if j % world == rank]


# ---------------------------------------------------------------- one worker's view


def test_take_renew_release(tmp_path):
    claims = ShardClaims(tmp_path, lease_s=60)
    claim = claims.take(3)
    assert claim is not None and (claim.host, claim.pid) == (host_name(), os.getpid())
    assert json.loads(claims.path(3).read_text())["expires"] == pytest.approx(time.time() + 60, abs=5)
    renewed = claims.renew(claim)
    assert renewed is not None and renewed.expires >= claim.expires and renewed.token == claim.token
    assert claims.renew(claim) is None  # the old bytes are no longer what the file holds
    claims.release(renewed)
    assert not claims.path(3).exists()


def test_a_claim_of_this_process_from_an_earlier_call_is_stale(tmp_path):
    """Our own pid counts as gone (durable.pid_alive): a claim of ours that we no longer track is
    from an earlier call that ended (in-process reruns)."""
    claims = ShardClaims(tmp_path, lease_s=60)
    first = claims.take(0)
    second = claims.take(0)
    assert first is not None and second is not None and second.token != first.token
    assert claims.renew(first) is None  # taken over: the first holder would drop the shard
    claims.release(first)  # not ours any more: left alone
    assert Claim.decode(claims.path(0).read_bytes()) == second


@pytest.mark.parametrize(
    "host, pid, expires_in, taken",
    [
        (None, DEAD, 60, True),  # this host, the holder's pid is gone (a killed worker)
        (None, LIVE, 60, False),  # this host, alive and within its lease
        (None, LIVE, -1, True),  # this host, alive but not renewing (hung): lease expired
        (OTHER, DEAD, 60, False),  # another host: its pid says nothing here, the lease holds
        (OTHER, LIVE, 60, False),
        (OTHER, 1, -1, True),  # another host's expired lease (a node that died)
    ],
)
def test_who_may_take_a_claim_over(tmp_path, host, pid, expires_in, taken):
    claims = ShardClaims(tmp_path, lease_s=60)
    held = write_claim(claims, 5, host or host_name(), pid, expires_in)
    assert claims.available(5) == taken
    got = claims.take(5)
    assert (got is not None) == taken
    now_held = Claim.decode(claims.path(5).read_bytes())
    assert now_held == (got if taken else held)
    assert leftovers(claims, 5) == (1 if taken else 0)  # a takeover leaves its marker, nothing else


def test_a_torn_claim_file_is_stale_once_a_lease_old(tmp_path):
    claims = ShardClaims(tmp_path, lease_s=60)
    claims.dir.mkdir()
    claims.path(2).write_bytes(b'{"shard": 2, "ho')
    assert claims.take(2) is None
    age(claims.path(2), 61)
    assert claims.take(2) is not None


# ---------------------------------------------------------------- leftovers on a shared filesystem


def test_another_hosts_temp_files_are_kept_while_its_claim_lives(tmp_path):
    """A second host writing shard 1 (unexpired claim, a pid that does not exist here) keeps its
    temp file; one of an expired claim, or of a dead pid on this host, is removed. A file of
    another host without any claim is kept while it is younger than a lease (plan.json, the
    manifest: written outside claims)."""
    claims = ShardClaims(tmp_path, lease_s=60)
    write_claim(claims, 1, OTHER, DEAD, 60)
    write_claim(claims, 2, "third-node", 77, -1)
    names = {
        "live": f".shard-00001.safetensors.tmp-{OTHER}-{DEAD}",
        "expired": ".shard-00002.safetensors.tmp-third-node-77",
        "young": f".plan.json.tmp-{OTHER}-55",
        "old": f".manifest.json.tmp-{OTHER}-56",
        "here_dead": f".shard-00003.json.tmp-{host_name()}-{DEAD}",
        "here_live": f".shard-00004.json.tmp-{host_name()}-{LIVE}",
        "old_form_dead": f".shard-00005.json.tmp-{DEAD}",
    }
    for key, name in names.items():
        (tmp_path / name).write_bytes(b"half")
        if key != "young":
            age(tmp_path / name, 3600)
    recover_dirs(tmp_path, claims.writer_alive)
    left = {key for key, name in names.items() if (tmp_path / name).exists()}
    assert left == {"live", "young", "here_live"}
    # without a judge for other hosts (checkpoints, exports) another host's files are never removed
    for key in ("expired", "old"):
        (tmp_path / names[key]).write_bytes(b"half")
        age(tmp_path / names[key], 3600)
    recover_dirs(tmp_path)
    assert (tmp_path / names["expired"]).exists() and (tmp_path / names["old"]).exists()


def test_temp_names_carry_the_host():
    path = Path("/store/shard-00001.safetensors")
    assert temp_path(path).name == f".shard-00001.safetensors.tmp-{host_name()}-{os.getpid()}"
    assert temp_path(path, "old").name.startswith(".shard-00001.safetensors.old-")


# ---------------------------------------------------------------- races between processes


def _race(target, args, n: int) -> list:
    """Run `target(barrier, queue, *args)` in n forked processes released together; their answers.
    Each stays alive until all have answered: a claim of an exited process is a dead worker's."""
    ctx = multiprocessing.get_context("fork")
    barrier, queue = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_stay, args=(target, barrier, queue, *args)) for _ in range(n)]
    for p in procs:
        p.start()
    answers = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return answers


def _stay(target, barrier, queue, *args) -> None:
    target(barrier, queue, *args)
    barrier.wait()


def _take(barrier, queue, store: str, j: int) -> None:
    claims = ShardClaims(Path(store), lease_s=60)
    barrier.wait()
    claim = claims.take(j)
    queue.put(None if claim is None else claim.token)


@pytest.mark.parametrize("held_by", [None, "dead-here", "expired-other"])
def test_racing_workers_one_claim_one_winner(tmp_path, held_by):
    """8 processes claim one shard at once: free, held by a dead pid of this host, or by another
    host whose lease expired (the takeover path: rename aside, check, create). One wins; the
    file then holds the winner's claim and nothing is left aside."""
    claims = ShardClaims(tmp_path, lease_s=60)
    if held_by == "dead-here":
        write_claim(claims, 0, host_name(), DEAD, 60)
    elif held_by == "expired-other":
        write_claim(claims, 0, OTHER, 1, -1)
    takeovers = 0 if held_by is None else 1
    for _ in range(3):
        tokens = _race(_take, (str(tmp_path), 0), 8)
        winners = [t for t in tokens if t is not None]
        assert len(winners) == 1, tokens
        assert Claim.decode(claims.path(0).read_bytes()).token == winners[0]
        assert leftovers(claims, 0) == takeovers  # one marker per takeover
        write_claim(claims, 0, host_name(), DEAD, 60)  # the winner "dies": the next round takes it over
        takeovers += 1


def _create(barrier, queue, path: str) -> None:
    barrier.wait()
    queue.put((os.getpid(), create_once(Path(path), f"written by {os.getpid()}\n" * 1000)))


def test_create_once_has_one_winner_and_the_file_is_whole(tmp_path):
    target = tmp_path / "manifest.json"
    answers = _race(_create, (str(target),), 8)
    winners = [pid for pid, won in answers if won]
    assert len(winners) == 1
    assert target.read_text() == f"written by {winners[0]}\n" * 1000
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]
