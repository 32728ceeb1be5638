"""The learner behind one handle: its calls, each with a deadline, and its restart when it dies or wedges.

The learner is one actor, or a learner group (learner.runtime.learner_group): an update goes to every rank, each with a
consecutive share of the iteration's rollouts; a publication to every rank (each keeps the version); the rest to rank
0. A rank that dies or wedges takes the group down: every rank is killed and the group started again.

A learner that dies, or wedges (no answer within its deadline; it is killed), is started again from the run's
latest checkpoint (learner.faults.max_restarts times, deaths and wedges together). The iterations since that checkpoint are
redone, identically, and weight versions continue from it. The deadline of a call is the larger of
learner.faults.call_timeout_s and learner.faults.call_timeout_update_factor times the slowest update answered so far: it grows
with what the run has shown an update to need, and a learner's start-up (a SmolVLA learner loads for minutes) is no
part of it: calls wait without one until the learner has answered its first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.exceptions import RayActorError

from common.config import RunConfig
from common.console import log
from learner.files.run_dir import RunDirectory
from learner.group.ranks import PeerRankError
from learner.runtime.failures import LearnerDiedError, LearnerWedgedError, stopped_by_sigterm, stops_held
from learner.runtime.ray_runtime import ResourceRequest
from learner.runtime.startup import start_learner


class LearnerHandle:
    """The run's learner actor, called with a deadline and restarted from the run's checkpoints."""

    def __init__(
        self, config: RunConfig, directory: RunDirectory, checkpoint: Path | None, resume_dir: Path | None, request: ResourceRequest
    ):
        """checkpoint: the policy the run fine-tunes (None on resume or from a random init); resume_dir: the
        checkpoint a resumed run continues from."""
        self.config, self.directory, self.request = config, directory, request
        self.checkpoint, self.resume_dir = checkpoint, resume_dir
        self.restarts = 0
        self.last_saved = 0  # completed iterations of the newest checkpoint the learner started from or wrote
        self.slowest_update = 0.0  # seconds, over every update answered, restarts included
        self._start(checkpoint, resume_dir)
        # Stalled tasks' demonstrations handed to this learner (each with the update from which they count): a restarted
        # learner gets them again, for the iterations it redoes as for the ones after (a checkpoint keeps those before it).
        self.demo_tasks: dict[str, int] = {}

    def _start(self, checkpoint: Path | None, resume_dir: Path | None) -> None:
        self.ranks = start_learner(self.config, checkpoint, resume_dir, self.request)
        self.actor = self.ranks.actors[0]
        self.answered = False
        if len(self.ranks.actors) > 1:
            log.info(f"[start] learner group: {self.ranks.where()}")

    def when_ready(self, callback: Callable[[], None]) -> None:
        """Call `callback()` once the learner is up (a group: rank 0, which is up once every rank has joined), without
        waiting for it; its failure surfaces at its first call."""
        self.actor.__ray_ready__.remote().future().add_done_callback(lambda _: callback())

    def deadline(self) -> float:
        """Seconds a call may take before the learner counts as wedged."""
        cfg = self.config.learner.faults
        return max(cfg.call_timeout_s, cfg.call_timeout_update_factor * self.slowest_update)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """`method(*args, **kwargs)` on the learner (a group's rank 0), waited for; LearnerDiedError if it dies,
        LearnerWedgedError (after killing it) if it does not answer in time."""
        return self._wait(method, [getattr(self.actor, method).remote(*args, **kwargs)])

    def call_every_rank(self, method: str, args: list[tuple] | None = None, **kwargs: Any) -> Any:
        """`method(*args[rank], **kwargs)` on every rank (no positional arguments without `args`), waited for as `call`
        does; rank 0's answer."""
        calls = zip(self.ranks.actors, args or [()] * len(self.ranks.actors), strict=True)
        return self._wait(method, [getattr(actor, method).remote(*rank_args, **kwargs) for actor, rank_args in calls])

    def _wait(self, method: str, refs: list[ray.ObjectRef]) -> Any:
        """The first ref's result, once every ref has answered. A rank that dies, or no answer from all within the
        deadline, kills every rank (LearnerDiedError, LearnerWedgedError). Where ranks raised, the error raised is
        a rank's own, not another's report of it (data_parallel.PeerRankError)."""
        timeout = self.deadline() if self.answered else None
        ends = None if timeout is None else time.monotonic() + timeout
        pending, errors = list(refs), []
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=None if ends is None else max(0.0, ends - time.monotonic()))
            if not ready:
                self.ranks.kill()
                raise LearnerWedgedError(
                    f"no answer to {method} within {timeout:g}s (learner.faults.call_timeout_s, "
                    "learner.faults.call_timeout_update_factor); killed"
                ) from None
            try:
                ray.get(ready[0])
            except RayActorError as exc:
                self.ranks.kill()
                raise LearnerDiedError(str(exc).splitlines()[0]) from exc
            except Exception as exc:  # raised by the learner's code: raised here once every rank has answered
                errors.append(exc)
        own = [error for error in errors if not isinstance(error, PeerRankError)]
        if errors:
            raise (own or errors)[0]
        self.answered = True
        return ray.get(refs[0])

    def resume_point(self) -> tuple[int, int]:
        """(completed iterations, env steps sampled for them) of the checkpoint the learner started from."""
        self.last_saved, env_steps = self.call("progress")
        return self.last_saved, env_steps

    def initial_weights(self) -> str:
        """The policy directory the rollout actors start from: a random-init run's learner saves its weights for them."""
        start = self.resume_dir or self.checkpoint
        return str(start) if start else self._save(self.directory.checkpoints / "random_init")

    def publish_in_flight(self) -> list[ray.ObjectRef]:
        """The weights that sample the next iterations (LearnerActor.publish_in_flight); the last is the current version."""
        return self.call_every_rank("publish_in_flight")

    def update(self, batch_refs: list[ray.ObjectRef], verbose: bool = False) -> dict[str, float]:
        """The update on the iteration's rollouts: each rank fetches its consecutive share of them from the object store."""
        began = time.perf_counter()
        size = len(self.ranks.actors)
        if len(batch_refs) < size:
            raise ValueError(f"{len(batch_refs)} rollout actors left for a learner group of {size} ranks: each rank needs one")
        shares = [tuple(share) for share in np.array_split(np.array(batch_refs, dtype=object), size)]
        metrics = self.call_every_rank("update", shares, verbose=verbose)
        self.slowest_update = max(self.slowest_update, time.perf_counter() - began)
        return metrics

    def add_demonstrations(self, tasks: dict[str, int]) -> list[str]:
        """Stalled tasks' demonstrations into every rank's updates from the iteration given with each; returns the tasks
        new to the learner (one it holds already, from its checkpoint or an earlier call, keeps its iteration)."""
        self.demo_tasks |= {task: start for task, start in tasks.items() if task not in self.demo_tasks}  # in the order given
        return self.call_every_rank("add_demonstrations", [(self.demo_tasks,)] * len(self.ranks.actors))

    def publish(self) -> ray.ObjectRef:
        """The current weights, put in the object store once (by rank 0)."""
        return self.call_every_rank("publish")[0]

    def save(self, iteration: int) -> None:
        """Checkpoint the learner as iter_NNNNNN and point the run's `latest` at it."""
        name = f"iter_{iteration:06d}"
        self._save(self.directory.checkpoints / name)
        self.directory.write_latest(name)
        self.last_saved = iteration
        if self.config.keep_checkpoints:
            self.directory.prune_checkpoints(self.config.keep_checkpoints)

    def _save(self, directory: Path) -> str:
        """The learner's checkpoint in `directory`: every rank of a group takes part (a sharded one gathers its shards
        to rank 0), and rank 0 writes it."""
        return self.call_every_rank("save", [(str(directory),)] * len(self.ranks.actors))

    def export_gauges(self, row: dict[str, float]) -> None:
        """Publish an iteration's metrics as Ray gauges, without waiting."""
        self.actor.export_gauges.remote(row)

    def restart(self, failure: LearnerDiedError) -> tuple[int, int]:
        """A new learner in place of the failed one, from the run's latest checkpoint (before the first, from what the
        run started with); returns its resume_point. Past learner.faults.max_restarts, LearnerDiedError."""
        self.restarts += 1
        limit = self.config.learner.faults.max_restarts
        if self.restarts > limit:
            raise LearnerDiedError(
                f"the learner died {self.restarts} times (learner.faults.max_restarts={limit}); last: {failure}"
            ) from failure
        restart_dir = self.directory.latest_checkpoint() if self.last_saved > 0 else self.resume_dir
        self.ranks.kill()  # what is left of it: a group's other ranks wait for the one gone, holding its placement
        what = "wedged" if isinstance(failure, LearnerWedgedError) else "died"
        log.info(
            f"[fault] the learner {what} ({failure}): restarting it ({self.restarts}/{limit}) from "
            f"{restart_dir or self.checkpoint or 'its random initialisation'}"
        )
        self._start(None if restart_dir else self.checkpoint, restart_dir)
        if self.demo_tasks:
            self.add_demonstrations({})
        return self.resume_point()

    def close(self) -> None:
        """The learner's actors and a group's placement, let go at the run's end (a placement outlives its handles)."""
        self.ranks.kill()

    def save_progress(self, error: BaseException) -> None:
        """Checkpoint the iterations completed since the last checkpoint, if the learner is still there to save them, and
        say which checkpoint `--resume` continues from. A run stopped before its first checkpoint saves its start
        (iter_000000), so that it too can be resumed rather than started again in a new directory."""
        what = (
            "stopped by SIGTERM"
            if stopped_by_sigterm(error)
            else "interrupted"
            if isinstance(error, KeyboardInterrupt)
            else f"stopped by {type(error).__name__}"
        )
        try:
            with stops_held("saving the checkpoint", stopping=True):
                completed, _ = ray.get(self.actor.progress.remote(), timeout=60)
                if completed > self.last_saved or not self.directory.has_checkpoint():
                    self.save(completed)
                    log.info(f"\n[{what}] saved iter_{completed:06d}; continue with --resume")
                else:
                    log.info(f"\n[{what}] iter_{completed:06d} holds every completed iteration; continue with --resume")
        except Exception as exc:  # the learner is gone or wedged: nothing more can be kept
            log.info(f"[fault] could not save the learner's progress ({type(exc).__name__}): --resume continues from the last checkpoint")
