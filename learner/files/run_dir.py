"""A run directory: held by one run at a time, its config fixed for its lifetime, its checkpoints found through a
checked pointer.

    run_dir/run.lock          {"pid", "host", "started"} while a run holds the directory; a lock whose process is
                              gone (same host) is stale and is taken over, with a message
    run_dir/run_config.json   the resolved config of the run; --resume refuses a different one and prints the fields
    run_dir/checkpoints/latest  the name of the newest complete checkpoint (iter_NNNNNN), replaced atomically
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from common.config import ConfigError, RunConfig
from common.config_loading import flatten
from common.console import log
from common.policy import CONFIG_FILE, WEIGHTS_FILE, CheckpointError, verify_checksums
from common.storage import RunFileWriteError, write_file_atomically
from learner.files.checkpoints import TRAINER_STATE_FILE

LATEST_FILE = "latest"
LOCK_FILE = "run.lock"
RUN_CONFIG_FILE = "run_config.json"
CHECKPOINT_NAME = re.compile(r"iter_\d{6}")
# Fields a resumed run may change without --allow-config-change: where and how often things are logged and saved,
# and the resources actors and the learner ask for. Nothing here changes what is computed, beyond float rounding (the
# learner's ranks).
SAFE_ON_RESUME = frozenset(
    {
        "eval_every",
        "eval_videos",
        "checkpoint_every",
        "keep_checkpoints",
        "wandb_project",
        "actors.num_cpus",
        "actors.num_gpus",
        "actors.resources",
        "actors.faults.max_restarts",
        "actors.faults.call_timeout_s",
        "actors.faults.min_alive",
        "learner.num_cpus",
        "learner.num_gpus",
        "learner.resources",
        "learner.num_learners",
        "learner.sharding",
        "learner.faults.max_restarts",
        "learner.faults.call_timeout_s",
        "learner.faults.call_timeout_update_factor",
    }
)


class RunDirLockedError(FileExistsError):
    """Another live run holds this run directory."""


class DiskSpaceWarning(UserWarning):
    """The checkpoints a run will keep need more space than the disk under its run directory has free."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunDirectory:
    def __init__(self, path: str | Path):
        if not str(path).strip():
            raise ConfigError("run_dir must not be empty (it would write into the current directory): pass --run-dir DIR")
        self.path = Path(path)
        self.checkpoints = self.path / "checkpoints"

    # -- ownership ---------------------------------------------------------------------------------

    @contextmanager
    def locked(self) -> Iterator[RunDirectory]:
        """Hold the directory for the duration of a run; a second run on it fails at once, naming the holder."""
        self.path.mkdir(parents=True, exist_ok=True)
        lock = self.path / LOCK_FILE
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")})
        for _ in range(2):
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._read_lock(lock)
                if holder.get("host") == socket.gethostname() and not _pid_alive(int(holder.get("pid", -1))):
                    log.info(f"[run_dir] {lock} was left by process {holder.get('pid')}, which is gone: taking it over")
                    lock.unlink(missing_ok=True)
                    continue
                raise RunDirLockedError(
                    f"{self.path} is in use by process {holder.get('pid')} on {holder.get('host')} (since {holder.get('started')}): "
                    f"wait for it, or pick another --run-dir (if that process is really gone, delete {lock})"
                ) from None
            with os.fdopen(fd, "w") as f:
                f.write(record)
            break
        self._clean_leftovers()
        try:
            yield self
        finally:
            lock.unlink(missing_ok=True)

    @staticmethod
    def _read_lock(lock: Path) -> dict[str, Any]:
        try:
            return json.loads(lock.read_text())
        except (OSError, json.JSONDecodeError):
            return {}

    def _clean_leftovers(self) -> None:
        """Temp and swap directories of checkpoint writes interrupted by a crash (see write_directory_atomically)."""
        if self.checkpoints.is_dir():
            for leftover in self.checkpoints.glob(".*.tmp-*"):
                shutil.rmtree(leftover, ignore_errors=True)
            for leftover in self.checkpoints.glob(".*.old-*"):
                shutil.rmtree(leftover, ignore_errors=True)

    # -- starting and resuming ------------------------------------------------------------------------

    def start_new(self, config: RunConfig) -> None:
        """Refuse a directory that already holds a run; record this run's config."""
        if (self.path / "metrics.jsonl").exists() or (self.checkpoints / LATEST_FILE).exists():
            raise FileExistsError(f"{self.path} already holds a run: continue it with --resume, or pick another --run-dir")
        write_file_atomically(self.path / RUN_CONFIG_FILE, json.dumps(config.to_dict(), indent=2, sort_keys=True), RunFileWriteError)

    def config_changes(self, config: RunConfig) -> dict[str, tuple[Any, Any]]:
        """field -> (stored, now) for every field that differs from the run's recorded config. A field added since the run
        was recorded differs from nothing at its default (which behaves as the code before it did)."""
        stored = recorded = flatten(json.loads((self.path / RUN_CONFIG_FILE).read_text()))
        current, defaults = flatten(config.to_dict()), flatten(RunConfig().to_dict())
        added_at_default = {k for k in set(current) - set(recorded) if k in defaults and current[k] == defaults[k]}
        return {
            k: (stored.get(k), current.get(k))
            for k in sorted(set(stored) | set(current) - added_at_default)
            if stored.get(k) != current.get(k)
        }

    def resume(self, config: RunConfig, allowed: frozenset[str] | set[str] = frozenset()) -> Path:
        """The checkpoint to continue from, after checking that the config is the run's own (bar allowed fields).

        `iterations` may grow, which extends the run (the learning-rate schedule then stretches over the new
        total from the checkpoint on), but never to or below the iterations the checkpoint has completed."""
        checkpoint = self.latest_checkpoint()
        completed = completed_iterations(checkpoint)
        if config.iterations <= completed:
            raise ConfigError(f"--resume: iterations={config.iterations} but {checkpoint} has completed {completed}: ask for more")
        if not (self.path / RUN_CONFIG_FILE).is_file():  # a run directory written before configs were recorded
            log.info(f"[run_dir] {self.path / RUN_CONFIG_FILE} is missing: the config cannot be compared with the run's")
            return checkpoint
        refused = {k: v for k, v in self.config_changes(config).items() if k not in SAFE_ON_RESUME | {"iterations"} | set(allowed)}
        if refused:
            listing = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in refused.items())
            raise ConfigError(
                f"--resume with a config that differs from the run's ({self.path / RUN_CONFIG_FILE}): {listing}. "
                "Resume with the run's own config, or pass --allow-config-change FIELD for each change you intend"
            )
        return checkpoint

    # -- checkpoints --------------------------------------------------------------------------------

    def latest_checkpoint(self) -> Path:
        """The checkpoint named by the `latest` pointer, checked; if it is unusable, the newest complete one before it."""
        pointer = self.checkpoints / LATEST_FILE
        if not pointer.is_file():
            raise FileNotFoundError(f"--resume: no checkpoint under {self.checkpoints} (looked for the '{LATEST_FILE}' pointer)")
        name = pointer.read_text().strip()
        if not CHECKPOINT_NAME.fullmatch(name):
            raise CheckpointError(f"{pointer} names {name!r}, not a checkpoint of this run (expected iter_NNNNNN)")
        problem = self.checkpoint_problem(self.checkpoints / name)
        if problem is None:
            return self.checkpoints / name
        earlier = sorted((p for p in self.checkpoints.glob("iter_*") if CHECKPOINT_NAME.fullmatch(p.name) and p.name < name), reverse=True)
        for candidate in earlier:
            if self.checkpoint_problem(candidate) is None:
                log.info(f"[run_dir] {self.checkpoints / name} is unusable ({problem}): resuming from {candidate.name}")
                return candidate
        raise CheckpointError(f"{self.checkpoints / name} is unusable ({problem}) and no earlier complete checkpoint exists")

    @staticmethod
    def checkpoint_problem(directory: Path) -> str | None:
        """Why a checkpoint directory cannot be resumed from, or None. Checks every file a resume reads."""
        if not directory.is_dir():
            return "missing"
        for name in (WEIGHTS_FILE, CONFIG_FILE, TRAINER_STATE_FILE):
            if not (directory / name).is_file() or (directory / name).stat().st_size == 0:
                return f"{name} missing or empty"
        try:
            verify_checksums(directory)
        except CheckpointError as exc:
            return str(exc)
        try:
            json.loads((directory / CONFIG_FILE).read_text())
        except json.JSONDecodeError as exc:
            return f"{CONFIG_FILE} is not valid JSON ({exc})"
        from safetensors import safe_open

        try:
            with safe_open(str(directory / WEIGHTS_FILE), "pt") as f:
                for key in f.keys():
                    f.get_slice(key)  # reads each tensor's header; a truncated file fails here or at open
        except Exception as exc:  # safetensors raises its own error types
            return f"{WEIGHTS_FILE} unreadable ({exc})"
        return None

    def has_checkpoint(self) -> bool:
        """Whether the run has saved a checkpoint (its `latest` pointer exists)."""
        return (self.checkpoints / LATEST_FILE).is_file()

    def write_latest(self, name: str) -> None:
        """Point `latest` at checkpoint `name`; a failed write (CheckpointWriteError) leaves the old pointer."""
        write_file_atomically(self.checkpoints / LATEST_FILE, name)

    def prune_checkpoints(self, keep: int) -> list[str]:
        """Delete every checkpoint (iter_NNNNNN) but the newest `keep` and the one `latest` names; returns the names
        deleted. Each is renamed first, so a crash part-way leaves a leftover that the next start removes, never a
        half-deleted checkpoint under its own name."""
        latest = (self.checkpoints / LATEST_FILE).read_text().strip()
        names = sorted(p.name for p in self.checkpoints.glob("iter_*") if CHECKPOINT_NAME.fullmatch(p.name) and p.is_dir())
        doomed = [name for name in names[: max(len(names) - keep, 0)] if name != latest]
        for name in doomed:
            old = self.checkpoints / f".{name}.old-{os.getpid()}"
            (self.checkpoints / name).rename(old)
            shutil.rmtree(old, ignore_errors=True)
        return doomed

    def warn_if_checkpoints_outgrow_the_disk(self, config: RunConfig, reference: Path | None, completed: int) -> None:
        """A DiskSpaceWarning, before the run starts, when the checkpoints it will keep need more than the disk under
        run_dir has free. Each is taken to be as large as `reference` (the checkpoint the run starts from)."""
        if reference is None:
            return
        every = config.checkpoint_every
        count = config.iterations // every - completed // every + (1 if config.iterations % every else 0)
        at_once = count if config.keep_checkpoints == 0 else min(count, config.keep_checkpoints + 1)  # a new one before the oldest goes
        size = sum(p.stat().st_size for p in reference.rglob("*") if p.is_file())
        existing = next(p for p in (self.checkpoints, *self.checkpoints.parents) if p.exists())
        free = shutil.disk_usage(existing).free
        if at_once * size > free:
            kept = "every one" if config.keep_checkpoints == 0 else f"the newest {config.keep_checkpoints}"
            warnings.warn(
                f"this run writes {count} checkpoints of about {megabytes(size)} under {self.checkpoints} and keeps {kept} "
                f"(keep_checkpoints={config.keep_checkpoints}): up to {megabytes(at_once * size)}, but the disk has "
                f"{megabytes(free)} free. Set keep_checkpoints (2 keeps the newest two), or free space; a full disk stops "
                "the run at a checkpoint, keeping the previous one",
                DiskSpaceWarning,
                stacklevel=2,
            )


def megabytes(size: int) -> str:
    """A size in MB, thousands separated: a checkpoint's run from a few MB (an MLP) to tens of thousands (pi0)."""
    return f"{size / 1e6:,.1f} MB"


def completed_iterations(checkpoint: Path | None) -> int:
    """The iterations a run's checkpoint (iter_NNNNNN) has completed; 0 for none."""
    return 0 if checkpoint is None else int(checkpoint.name.removeprefix("iter_"))


def policy_directory(path: Path) -> Path:
    """The policy checkpoint that `path` names, for the tools that read one (learner.replay, learner.export): a policy
    directory written by save_pretrained as it is, or a run directory or its checkpoints/ directory for the run's latest
    checkpoint (RunDirectory.latest_checkpoint). ValueError says why there is none."""
    if not path.exists():
        raise ValueError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} is not a directory")
    checkpoints = path / "checkpoints" if (path / RUN_CONFIG_FILE).is_file() else path
    if (checkpoints / LATEST_FILE).is_file():
        return RunDirectory(checkpoints.parent).latest_checkpoint()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / name).is_file():
            raise ValueError(f"checkpoint {path} has no {name}: pass a policy directory written by save_pretrained, or a run directory")
    return path
