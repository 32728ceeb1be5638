"""File digests kept per file version: a checkpoint's files are hashed once per process, and the processes a run
starts take the driver's digests; any change to a file is hashed again, so a corrupt file is still caught."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

import pytest

from common import file_digests
from common.file_digests import file_sha256, known_digests
from common.policy import WEIGHTS_FILE, CheckpointError, FlowPolicy, verify_checksums
from learner.runtime.startup import resolve_init_checkpoint
from tests.conftest import tiny_config


def rewrite_keeping_size_and_mtime(path: Path, data: bytes) -> None:
    """New bytes of the same length, and the old modification time put back: only the change time tells."""
    stat = path.stat()
    path.write_bytes(data)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns


def test_a_file_version_is_read_once_and_a_rewrite_or_a_copy_is_read_again(tmp_path, hashed_files) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"a" * 5000)
    assert file_sha256(path) == file_sha256(path) == hashlib.sha256(b"a" * 5000).hexdigest()
    assert hashed_files == [path]

    time.sleep(0.01)  # past the file system's clock tick, so that the change time moves
    rewrite_keeping_size_and_mtime(path, b"b" * 5000)
    assert file_sha256(path) == hashlib.sha256(b"b" * 5000).hexdigest()
    copy = tmp_path / "copy.bin"
    shutil.copy2(path, copy)  # the same bytes and mtime, another inode
    assert file_sha256(copy) == file_sha256(path)
    assert hashed_files == [path, path, copy]


def test_a_file_changed_moments_ago_is_read_at_every_call(tmp_path, monkeypatch) -> None:
    """Within RACY_SECONDS of a change a further write could keep the file's identity: nothing is kept."""
    monkeypatch.setattr(file_digests, "_digests", {})
    path = tmp_path / "fresh.bin"
    path.write_bytes(b"x" * 100)
    assert file_digests.RACY_SECONDS >= 1
    assert file_sha256(path) == hashlib.sha256(b"x" * 100).hexdigest()
    assert known_digests() == {}


def test_a_checkpoint_corrupted_after_a_verified_load_is_refused(tmp_path, mlp_checkpoint, hashed_files) -> None:
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(mlp_checkpoint, checkpoint)
    weights = checkpoint / WEIGHTS_FILE
    FlowPolicy.from_pretrained(checkpoint)
    FlowPolicy.from_pretrained(checkpoint)
    assert hashed_files.count(weights) == 1
    time.sleep(0.01)
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # a flipped bit, same size, same mtime
    rewrite_keeping_size_and_mtime(weights, bytes(data))
    with pytest.raises(CheckpointError, match=f"{weights} does not match its sha256"):
        verify_checksums(checkpoint)


def test_a_corrupt_cached_bc_checkpoint_stops_the_driver_before_the_learner_starts(tmp_path, mlp_checkpoint, monkeypatch) -> None:
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(mlp_checkpoint, checkpoint)
    data = bytearray((checkpoint / WEIGHTS_FILE).read_bytes())
    data[-1] ^= 0xFF
    (checkpoint / WEIGHTS_FILE).write_bytes(bytes(data))
    monkeypatch.setattr("learner.runtime.startup.ensure_bc_checkpoint", lambda config: checkpoint)
    with pytest.raises(CheckpointError, match="does not match its sha256"):
        resolve_init_checkpoint(tiny_config(tmp_path))
