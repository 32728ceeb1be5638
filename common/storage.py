"""Checkpoint directories on disk: written atomically with a checksum of every file, verified on every load, and
read as safetensors (never pickle). Ray-free, and used for every directory a run writes: policies, learner
checkpoints, the BC cache."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
from safetensors.torch import load_file
from torch import Tensor

from common.file_digests import file_sha256

CHECKSUMS_FILE = "checksums.json"  # sha256 of every other file, written with the directory (write_directory_atomically)


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, malformed, or does not match the model it is loaded into."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, an unwritable directory): what it was to replace is untouched,
    and no partial copy is left. Its text is one line: what, the system's reason, the file."""

    @classmethod
    def of(cls, what: str | Path, error: OSError) -> CheckpointWriteError:
        """The error for writing `what` that failed with `error`, in one line: the system's reason and the file."""
        reason = error.strerror or str(error)
        return cls(f"could not write {what}: {reason}" + (f" ({Path(error.filename).name})" if error.filename else ""))


class RunFileWriteError(CheckpointWriteError):
    """A run's own record (metrics.jsonl, summary.json) could not be written: the rows and summary written before stay
    as they were (a torn last line is cut when the log is opened again), and so does the latest checkpoint."""


def write_file_atomically(path: Path, text: str, error: type[CheckpointWriteError] = CheckpointWriteError) -> None:
    """`text` into `path` (its folder made if need be) through a temporary sibling of this process and thread renamed
    over it: a reader sees the previous file or the new one whole, writers racing each other leave one of their files
    whole, and a failed write (a full disk) leaves the previous file as it was, and no temporary one, raising `error`
    naming `path` in one line."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise error.of(path, exc) from exc


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_directory_atomically(directory: str | Path, write: Callable[[Path], None]) -> Path:
    """Call write(tmp) on a fresh sibling temp directory, then swap it into place with renames only,
    so a crash at any point leaves either the old directory or the new one, never half of either. A write that
    fails (an OSError: a full disk, an unwritable directory) removes the temp directory and raises
    CheckpointWriteError naming `directory`.

    Before the swap, every file's sha256 goes into CHECKSUMS_FILE (verified by every load, verify_checksums)
    and every file and directory is fsynced, so a power cut cannot leave a renamed directory of empty files."""
    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        write(tmp)
        # A copied checkpoint brings its own listing, which cannot list itself: it is written anew from the files.
        files = sorted(p for p in tmp.rglob("*") if p.is_file() and p != tmp / CHECKSUMS_FILE)
        checksums = {str(p.relative_to(tmp)): file_sha256(p) for p in files}
        (tmp / CHECKSUMS_FILE).write_text(json.dumps(checksums, indent=2, sort_keys=True))
        for path in [*files, tmp / CHECKSUMS_FILE, *(p for p in tmp.rglob("*") if p.is_dir()), tmp]:
            _fsync(path)
    except BaseException as exc:  # a full disk, or any other stop: the half-written copy goes, the old directory stays
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            raise CheckpointWriteError.of(directory, exc) from exc
        raise
    if directory.exists():
        directory.rename(old)
    tmp.rename(directory)
    _fsync(directory.parent)
    shutil.rmtree(old, ignore_errors=True)
    return directory


def verify_checksums(directory: str | Path) -> None:
    """Every file listed in the directory's CHECKSUMS_FILE is there with its recorded sha256, or CheckpointError
    names the file. A directory without the file (written by hand, or before checksums existed) passes."""
    directory = Path(directory)
    listing = directory / CHECKSUMS_FILE
    if not listing.is_file():
        return
    try:
        checksums = json.loads(listing.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{listing} is not valid JSON ({exc}): the checkpoint is corrupt") from None
    for name, expected in checksums.items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing but {listing} lists it: the checkpoint is incomplete")
        if file_sha256(path) != expected:
            raise CheckpointError(f"{path} does not match its sha256 in {listing}: the file is corrupt")


def directory_contents(directory: str | Path, verify: bool = True) -> dict[str, np.ndarray]:
    """Every file of a checkpoint directory (its CHECKSUMS_FILE included), by its path inside it, read whole as bytes
    (uint8 arrays: Ray's object store hands them to another process without a copy) once its checksums are verified
    (verify=False: a directory this process has just written, whose checksums it computed from those very files):
    what another node writes as a copy of it (write_directory_contents)."""
    directory = Path(directory)
    if verify:
        verify_checksums(directory)
    files = sorted(path for path in directory.rglob("*") if path.is_file())
    return {path.relative_to(directory).as_posix(): np.fromfile(path, dtype=np.uint8) for path in files}


def write_directory_contents(directory: str | Path, contents: dict[str, np.ndarray]) -> Path:
    """`contents` (directory_contents of a directory read elsewhere) written as `directory`, atomically and with its
    checksums (write_directory_atomically). A file whose bytes do not match the sha256 its listing gives, or a name
    that leaves the directory, is a CheckpointError, and nothing is written."""
    listed = json.loads(contents[CHECKSUMS_FILE].tobytes()) if CHECKSUMS_FILE in contents else {}

    def write(tmp: Path) -> None:
        for name, data in contents.items():
            if name == CHECKSUMS_FILE:
                continue  # written anew from the files, after each file is compared with the sender's listing
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise CheckpointError(f"{name!r} is not a path inside the checkpoint {directory}")
            if name in listed and hashlib.sha256(memoryview(data)).hexdigest() != listed[name]:
                raise CheckpointError(f"{name} of {directory} does not match its sha256 in {CHECKSUMS_FILE}: the copy is corrupt")
            path = tmp / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(memoryview(data))

    return write_directory_atomically(directory, write)


def read_safetensors(path: Path) -> dict[str, Tensor]:
    """Every tensor of a safetensors file; a corrupt or truncated file is a CheckpointError naming it."""
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise CheckpointError(f"{path} could not be read as safetensors: {exc}") from exc
