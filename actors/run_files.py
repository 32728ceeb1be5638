"""The run's files stay on the driver's node: a learner or rollout actor on another node reads its starting policy from
there and writes its checkpoints there, through Ray's object store.

The nodes of a cluster share no file system unless one is mounted. cluster/h200.yaml mounts none, and its head, where
the driver runs and keeps the run directory (metrics, `latest`, the exports' source), hosts no learner or actor: a
learner writing its checkpoints on its own node would leave `latest` pointing at nothing on the head, and an actor
there could not read the BC checkpoint the driver built. Here a process on another node fetches a directory whole from
the driver's node (a task pinned there reads it, checksums verified) into that node's temporary directory, where it
is kept by its content: the actors of a node, and their restarts, fetch it once between them. What the learner writes
goes to a task there that writes it atomically. On the driver's node every path is read and written in place, as on
one machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from common.file_digests import short_digest
from common.storage import CHECKSUMS_FILE, directory_contents, write_directory_contents

FETCHED_DIR = "flowrl-fetched"  # in a node's temporary directory: the directories fetched from the files' node


def checksum_listing(directory: str) -> str | None:
    """The text of the directory's CHECKSUMS_FILE (the sha256 of each of its files), None without one."""
    listing = Path(directory) / CHECKSUMS_FILE
    return listing.read_text() if listing.is_file() else None


@dataclass(frozen=True)
class RunFiles:
    """Where the run's files are: the Ray node `node_id` (the driver's, RunFiles.of_this_node()); None: the node
    of whoever holds it (a learner or actor made without Ray)."""

    node_id: str | None = None

    @classmethod
    def of_this_node(cls) -> RunFiles:
        return cls(ray.get_runtime_context().get_node_id())

    def here(self) -> bool:
        """Whether this process runs on the node that holds the run's files."""
        return self.node_id is None or ray.get_runtime_context().get_node_id() == self.node_id

    @contextlib.contextmanager
    def local_copy(self, directory: str | Path) -> Iterator[Path]:
        """`directory` itself on the files' node. Elsewhere a copy fetched from there into this node's FETCHED_DIR, under
        the sha256 of its checksum listing; a directory without one (written by hand) into a temporary copy, removed
        when the block ends."""
        if self.here():
            yield Path(directory)
            return
        listing = ray.get(self._on_files_node(checksum_listing).remote(str(directory)))
        if listing is None:
            with tempfile.TemporaryDirectory(prefix="flowrl-fetched-") as tmp:
                yield write_directory_contents(Path(tmp) / Path(directory).name, self._fetch(directory))
            return
        root = Path(tempfile.gettempdir()) / FETCHED_DIR
        root.mkdir(exist_ok=True)
        key = short_digest(listing)
        copy = root / key / Path(directory).name
        with open(root / f"{key}.lock", "w") as lock:  # the node's other actors wait for the first one's copy
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not copy.is_dir():
                write_directory_contents(copy, self._fetch(directory))
        yield copy

    def _fetch(self, directory: str | Path) -> dict:
        return ray.get(self._on_files_node(directory_contents).remote(str(directory)))

    def write(self, directory: str | Path, write: Callable[[Path], Path]) -> Path:
        """`write(path)` writes a directory atomically at `path` (LearnerCheckpoint.save): at `directory` on the files'
        node; elsewhere into a temporary directory here, whose files are then written as `directory` there."""
        if self.here():
            return write(Path(directory))
        with tempfile.TemporaryDirectory(prefix="flowrl-written-") as tmp:
            contents = directory_contents(write(Path(tmp) / Path(directory).name), verify=False)  # hashed as it was written
            ray.get(self._on_files_node(write_directory_contents).remote(str(directory), contents))
        return Path(directory)

    def _on_files_node(self, function: Callable) -> Any:
        """`function` as a Ray task pinned to the files' node, asking for no resources (a head that hosts no work runs it)."""
        return ray.remote(function).options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(self.node_id, soft=False))
