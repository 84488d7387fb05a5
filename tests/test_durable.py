"""durable.replace_dir / recover_dir on plain files: what each leftover of a killed writer becomes
(the real kill -9 runs are in test_reliability.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from specctl.durable import Owner, recover_dir, recover_dirs, replace_dir, write_atomic

DEAD = 2**30 - 1  # above any Linux pid_max: no process has it
OWNER = Owner("the test", ("f.txt", "model.safetensors"), "use another path")


def write_dir(path: Path, text: str) -> Path:
    path.mkdir(parents=True)
    (path / "f.txt").write_text(text)
    return path


def test_replace_dir_swaps_whole_and_leaves_nothing_beside(tmp_path):
    out = tmp_path / "export"
    replace_dir(out, lambda tmp: (tmp / "f.txt").write_text("one"), OWNER)
    replace_dir(out, lambda tmp: (tmp / "f.txt").write_text("two"), OWNER)
    assert (out / "f.txt").read_text() == "two"
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_files_get_the_umask_modes_whoever_wrote_them(tmp_path, mask):
    """safetensors writes 0o600: a vLLM server running as another user could not read an export."""
    import torch
    from safetensors.torch import save_file

    def write(tmp: Path) -> None:
        save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text("{}")
        os.chmod(tmp / "config.json", 0o600)

    before = os.umask(mask)
    try:
        replace_dir(tmp_path / "export", write, OWNER)
    finally:
        os.umask(before)
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "export").iterdir()}
    assert modes == {"model.safetensors": 0o666 & ~mask, "config.json": 0o666 & ~mask}


def test_a_failing_write_leaves_the_old_directory(tmp_path):
    out = write_dir(tmp_path / "export", "old")

    def fail(tmp: Path) -> None:
        (tmp / "f.txt").write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        replace_dir(out, fail, OWNER)
    assert (out / "f.txt").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def test_recover_puts_back_an_old_dir_caught_between_the_renames(tmp_path):
    write_dir(tmp_path / f".export.old-{DEAD}", "old")
    write_dir(tmp_path / f".export.tmp-{DEAD}", "new, whole or not")
    recover_dir(tmp_path / "export")
    assert (tmp_path / "export" / "f.txt").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def test_recover_drops_an_old_dir_once_the_new_one_is_in_place(tmp_path):
    write_dir(tmp_path / "step-4", "new")
    write_dir(tmp_path / f".step-4.old-{DEAD}", "old")
    write_dir(tmp_path / f".step-8.tmp-{DEAD}", "half")
    recover_dirs(tmp_path)
    assert (tmp_path / "step-4" / "f.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4"]


def test_recover_leaves_a_live_writer_alone(tmp_path):
    live = tmp_path / f".export.tmp-{os.getppid()}"  # the test runner's parent: alive
    write_dir(live, "being written")
    other = write_dir(tmp_path / f".export2.tmp-{DEAD}", "another name")
    recover_dir(tmp_path / "export")
    assert live.exists() and other.exists()
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize("durable", [True, False])
def test_write_atomic_replaces_whole_and_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch, durable):
    path = tmp_path / "report.json"
    write_atomic(path, "old", durable=durable)
    write_atomic(path, b"new", durable=durable)
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["report.json"]

    def refused(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(OSError, match="No space"):
        write_atomic(path, "lost", durable=durable)
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["report.json"]
