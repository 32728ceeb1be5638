"""sha256 digests: of files, each computed once per file version in a process and handed to the processes it starts; and
short ones (short_digest) that name what a cache keeps.

A checkpoint's checksums are verified by every load (common.policy.base.verify_checksums), and a run reads its
initial weights in the driver (the checks before any work, the banner, the manifest), the learner and every rollout
actor. For a 16 GB pi0 checkpoint each full hash takes seconds of CPU: a digest is therefore kept by the file's
identity (device, inode, size, modification and change times), which any write, replacement or copy changes, and a
later read of the same version takes the kept digest. The driver hands its digests to the learner and the actors
(`known_digests`, `trust_digests`): an actor on the driver's machine finds the file unchanged and hashes nothing, one
on another machine sees another identity and hashes its own copy.

No digest is kept from a file changed less than RACY_SECONDS before its hashing began: a write in the same tick of the
file system's clock could leave its identity unchanged (git's "racily clean" entries, the same rule)."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

RACY_SECONDS = 2.0  # coarser than any file system's timestamps a checkpoint lives on (FAT's 2 s included)

FileIdentity = tuple[int, int, int, int, int]
_digests: dict[FileIdentity, str] = {}


def file_identity(path: Path) -> FileIdentity:
    """What changes whenever the file's bytes can have changed: device, inode, size, mtime and ctime (ns)."""
    stat = path.stat()
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


def hash_file(path: Path) -> str:
    """The sha256 of the file's bytes, read now."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_sha256(path: Path) -> str:
    """The sha256 of `path`: the digest kept for this version of the file, else hashed now (and kept unless racy)."""
    identity = file_identity(path)
    if identity in _digests:
        return _digests[identity]
    started = time.time()
    digest = hash_file(path)
    # A later write could keep the identity only if it fell in the same clock tick as the last change before the read.
    if file_identity(path) == identity and started - max(identity[3], identity[4]) / 1e9 > RACY_SECONDS:
        _digests[identity] = digest
    return digest


def known_digests() -> dict[FileIdentity, str]:
    """The digests this process keeps, for the processes it starts (trust_digests)."""
    return dict(_digests)


def trust_digests(digests: dict[FileIdentity, str] | None) -> None:
    """Keep another process's digests (known_digests): they serve only files whose identity is still theirs."""
    _digests.update(digests or {})


def short_digest(content: str | dict[str, Any], length: int = 16) -> str:
    """The first `length` hex digits of the sha256 of `content`: text as it is, a mapping as JSON with its keys sorted (the
    same mapping, the same digest, in any order)."""
    text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:length]
