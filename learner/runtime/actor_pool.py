"""The rollout actors as one pool: every call has a deadline, and a dead or wedged actor is restarted and asked again.

A rollout actor that dies, or wedges (no answer within actors.faults.call_timeout_s; it is killed), is restarted by Ray
(actors.faults.max_restarts) and its call retried with the same arguments. A call that holds several bounded pieces of
work has the deadline once per piece: a held-out evaluation once per group of episodes the actor runs together, so a
long evaluation on a slow machine is not taken for a wedged actor. A restarted actor's start-up has a deadline of its
own (actors.faults.call_timeout_s again), so the retried call's allowance is the call's alone. A rollout is a pure function of (weights, run
seed, iteration, actor index), so the retry yields exactly the samples the dead attempt would have: its partial work
never reaches the learner, nothing is lost or counted twice. With its restarts spent the actor is dropped with a
warning and the rest go on; below actors.faults.min_alive the run stops.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, OwnerDiedError, RayActorError

from actors.rollout_actor import RolloutActor
from common.config import RunConfig
from common.console import log
from common.rollout import episode_groups
from learner.runtime.failures import ActorsExhaustedError, LearnerDiedError

# How often a restarted actor that has not answered is sent a no-op call. Ray numbers an actor's calls and a restarted
# actor runs them in that order: calls that failed while it restarted leave gaps it waits on until a later call tells it
# they failed, and the retried call alone may be that later call too early. The next no-op call closes the gaps.
NUDGE_INTERVAL_S = 2.0


@dataclass
class PendingCall:
    """One method call on every actor of a pool, submitted and not yet collected (ActorPool.collect)."""

    method: Callable[..., Any]  # the actor class's own method (RolloutActor.sample_with_receipt), called on each actor
    args_for: Callable[[int], tuple]
    num_returns: int
    refs: dict[int, list[ray.ObjectRef]]  # the current attempt's result refs, by actor index
    retried: set[int] = field(default_factory=set)
    allowances: dict[int, int] = field(default_factory=dict)  # actor index -> deadlines its call has (absent: one)


class ActorPool:
    """The rollout actors by index, called with a deadline; see the module docstring for what a fault does."""

    def __init__(self, config: RunConfig, start_actor: Callable[[int], Any], keep_alive: Iterable[Any] = ()):
        self.cfg = config.actors
        self.actors = {index: start_actor(index) for index in range(self.cfg.num_actors)}
        self.restarts = dict.fromkeys(self.actors, 0)  # restarts seen, by actor index (dropped actors' included)
        self.pids: dict[int, int] = {}  # the process each actor last answered from (wait_started, the receipts)
        self.suspected: set[int] = set()  # actors seen dying or killed, whose process is asked at their next answer
        # What the actors were created with (the layout tables' actor): Ray re-runs an actor's constructor with it when it
        # restarts the actor, so it must live as long as the pool, not just until the actors first start.
        self.keep_alive = list(keep_alive)
        self.faults = {
            "faults/actor_restarts": 0.0,
            "faults/actor_timeouts": 0.0,
            "faults/dropped_actors": 0.0,
            "faults/resampled_env_steps": 0.0,
        }

    def wait_started(self) -> None:
        """Wait until every actor is up, and note the process each runs in: a receipt from another process later means
        Ray restarted the actor. Not a pool call: start-up (a SmolVLA actor loads for minutes) is no part of
        actors.faults.call_timeout_s, and an actor that fails to start fails with its error."""
        indices = list(self.actors)
        self.pids = dict(zip(indices, ray.get([self.actors[index].pid.remote() for index in indices]), strict=True))

    def call(
        self,
        method: Callable[..., Any],
        args_for: Callable[[int], tuple],
        indices: Iterable[int] | None = None,
        num_returns: int = 1,
        allowances: dict[int, int] | None = None,
    ) -> dict[int, list[ray.ObjectRef]]:
        """`method(*args_for(index))` on the live actors (or those of `indices`); returns the result refs of each call
        that succeeded, by actor index. A call's first result must be small: the driver fetches it to learn whether
        the call succeeded (a receipt), and leaves any other result in the object store. `allowances`: how many times
        actors.faults.call_timeout_s an actor's call may take, by actor index (absent: once)."""
        return self.collect(self.submit(method, args_for, indices, num_returns, allowances))

    def submit(
        self,
        method: Callable[..., Any],
        args_for: Callable[[int], tuple],
        indices: Iterable[int] | None = None,
        num_returns: int = 1,
        allowances: dict[int, int] | None = None,
    ) -> PendingCall:
        """Start `call` without waiting: the actors queue it behind the calls they already have."""
        call = PendingCall(method, args_for, num_returns, {}, allowances=dict(allowances or {}))
        for index in self.actors if indices is None else indices:
            self._attempt(call, index)
        return call

    def _attempt(self, call: PendingCall, index: int) -> None:
        refs = getattr(self.actors[index], call.method.__name__).options(num_returns=call.num_returns).remote(*call.args_for(index))
        call.refs[index] = refs if call.num_returns > 1 else [refs]

    def collect(self, call: PendingCall) -> dict[int, list[ray.ObjectRef]]:
        """Wait for a submitted call; dead actors are asked again after their restart, wedged ones killed first."""
        timeout = self.cfg.faults.call_timeout_s
        pending = {index: refs for index, refs in call.refs.items() if index in self.actors}  # not those dropped since
        # The deadline runs from now: a call submitted ahead (policy_lag) waited behind the actor's previous one.
        since = dict.fromkeys(pending, time.monotonic())  # when each call's current attempt (or its actor's restart) started
        starting: dict[int, ray.ObjectRef] = {}  # actors restarting, by index: the reference that resolves once they are up
        nudged: dict[int, float] = {}  # retried actors, by index: when they were last sent a call (NUDGE_INTERVAL_S)
        done: dict[int, list[ray.ObjectRef]] = {}
        retried = call.retried

        def deadline(index: int) -> float:
            """A restarting actor's start-up has one call_timeout_s; its call has its allowances' worth."""
            return timeout if index in starting else timeout * call.allowances.get(index, 1)

        def retry(index: int) -> None:
            """Ask the (restarting) actor again: its start-up, then the call, each within the deadline."""
            retried.add(index)
            starting[index] = self.actors[index].__ray_ready__.remote()  # an actor runs its calls in order: this one first
            self._attempt(call, index)
            pending[index], since[index] = call.refs[index], time.monotonic()
            nudged[index] = since[index]

        def nudge_restarted() -> None:
            """A no-op call to each retried actor silent for NUDGE_INTERVAL_S: it closes the gaps in its call order (see
            NUDGE_INTERVAL_S). It queues behind the call, so it is not the start-up probe, which must run before it."""
            for index in set(pending) & set(nudged):
                if time.monotonic() - nudged[index] >= NUDGE_INTERVAL_S:
                    self.actors[index].__ray_ready__.remote()
                    nudged[index] = time.monotonic()

        while pending:
            nudge_restarted()
            receipts = {refs[0]: index for index, refs in pending.items()} | {ref: index for index, ref in starting.items()}
            wait = max(0.0, min(since[index] + deadline(index) for index in pending) - time.monotonic())
            if set(pending) & set(nudged):
                wait = min(wait, NUDGE_INTERVAL_S)
            # All answers at once (then handled in actor order), but a restarted actor's start-up as soon as it is up
            ready = set(ray.wait(list(receipts), num_returns=1 if starting else len(receipts), timeout=wait)[0])
            for ref, index in receipts.items():
                if index not in pending:  # dropped or done earlier in this pass
                    continue
                if starting.get(index) == ref:
                    if ref in ready:  # up (or dead again, which its call's receipt tells): the call's own time starts
                        del starting[index]
                        since[index] = time.monotonic()
                    continue
                if ref in ready:
                    try:
                        receipt = ray.get(ref)
                    except ActorDiedError as exc:  # dead for good: Ray has no restart left for it
                        self._drop(index, f"died ({exc.__class__.__name__}) with its {self.cfg.faults.max_restarts} restarts spent")
                        del pending[index]
                        starting.pop(index, None)
                        continue
                    except OwnerDiedError as exc:  # the weights it was given were put by a learner that has died since
                        raise LearnerDiedError(
                            f"the learner that published the weights of rollout actor {index}'s {call.method.__name__} call died"
                        ) from exc
                    except RayActorError:  # died and restarting (or briefly unreachable): ask the restarted actor
                        self.suspected.add(index)
                        time.sleep(0.5)
                        retry(index)
                        continue
                    done[index] = pending.pop(index)
                    if isinstance(receipt, dict) and "pid" in receipt:
                        self._note_process(index, receipt["pid"], call.method.__name__)
                    if index in retried and isinstance(receipt, dict):
                        self.faults["faults/resampled_env_steps"] += receipt.get("env_steps", 0)
                elif time.monotonic() - since[index] >= deadline(index):  # wedged: kill it, Ray restarts it, ask again
                    what = "its restart" if index in starting else call.method.__name__
                    times = "" if deadline(index) == timeout else f"{call.allowances[index]} x "
                    log.info(
                        f"[fault] rollout actor {index} wedged (no answer to {what} within {times}actors.faults.call_timeout_s="
                        f"{timeout:g}s): killing it"
                    )
                    self.faults["faults/actor_timeouts"] += 1
                    ray.kill(self.actors[index], no_restart=False)
                    self.suspected.add(index)
                    retry(index)
        for index in self.suspected & set(done):  # answered since a death or a kill: was it a restarted actor's answer?
            self._ask_process(index, call.method.__name__)
            self.suspected.discard(index)
        return done

    def _ask_process(self, index: int, method: str) -> None:
        """Note the process actor `index` runs in, asked after the calls queued before the question (within the call
        deadline; an actor busy beyond it is asked again by its next receipt)."""
        with contextlib.suppress(GetTimeoutError):
            self._note_process(index, ray.get(self.actors[index].pid.remote(), timeout=self.cfg.faults.call_timeout_s), method)

    def _note_process(self, index: int, pid: int, method: str) -> None:
        """Actor `index` answered `method` from process `pid`: another process than its last one is a restart (Ray
        restarts it; this keeps the books). Two restarts between answers count as one."""
        if self.pids.get(index, pid) != pid:
            self.restarts[index] += 1
            self.faults["faults/actor_restarts"] += 1
            log.info(
                f"[fault] rollout actor {index} restarted ({self.restarts[index]}/{self.cfg.faults.max_restarts} restarts): "
                f"it answered {method} from a new process"
            )
        self.pids[index] = pid

    def health(self) -> dict[str, float]:
        """Each actor's figures by its index: alive (1 while in the pool, 0 once dropped) and the restarts seen."""
        metrics = {}
        for index, restarts in self.restarts.items():
            metrics[f"actor/{index}/alive"] = float(index in self.actors)
            metrics[f"actor/{index}/restarts"] = float(restarts)
        return metrics

    def _drop(self, index: int, failure: str) -> None:
        """Go on without actor `index`; below actors.faults.min_alive actors, stop."""
        del self.actors[index]
        self.faults["faults/dropped_actors"] += 1
        message = f"rollout actor {index} {failure} (actors.faults.max_restarts): dropped"
        if len(self.actors) < self.cfg.faults.min_alive:
            raise ActorsExhaustedError(f"{message}; {len(self.actors)} left, below actors.faults.min_alive={self.cfg.faults.min_alive}")
        warnings.warn(f"{message}; training goes on with the {len(self.actors)} left", RuntimeWarning, stacklevel=3)

    def submit_sample(self, weights_ref: ray.ObjectRef, iteration: int) -> PendingCall:
        """Every live actor's rollout of `iteration` with the weights of `weights_ref`, started."""
        return self.submit(RolloutActor.sample_with_receipt, lambda index: (weights_ref, iteration), num_returns=2)

    def collect_sample(self, call: PendingCall) -> list[ray.ObjectRef]:
        """The rollouts of a submitted sample call (refs, in actor order)."""
        results = self.collect(call)
        return [results[index][1] for index in sorted(results)]

    def submit_evaluate(self, weights_ref: ray.ObjectRef, eval_layouts: list, todo: np.ndarray | None = None) -> PendingEvaluation:
        """Start a deterministic held-out evaluation without waiting, the layouts of `todo` (by default all) split across
        the live actors: they run it after the calls they already have, so the learner goes on training meanwhile."""
        todo = np.arange(len(eval_layouts)) if todo is None else todo
        shares = {index: share for index, share in zip(sorted(self.actors), np.array_split(todo, len(self.actors))) if len(share)}
        layouts_of = {index: [eval_layouts[i] for i in share] for index, share in shares.items()}
        groups = {index: episode_groups(layouts, self.cfg.envs_per_actor) for index, layouts in layouts_of.items()}
        call = self.submit(RolloutActor.evaluate, lambda index: (weights_ref, layouts_of[index]), indices=shares, allowances=groups)
        return PendingEvaluation(call, shares, weights_ref, eval_layouts, np.zeros(len(eval_layouts), dtype=bool), set())

    def collect_evaluate(self, pending: PendingEvaluation) -> tuple[np.ndarray, set[int]]:
        """Wait for a submitted evaluation; the share of an actor dropped meanwhile is dealt out again."""
        results = self.collect(pending.call)
        for index, (ref,) in results.items():
            version, values = ray.get(ref)
            pending.successes[pending.shares[index]] = values
            pending.versions.add(version)
        todo = [pending.shares[index] for index in pending.shares if index not in results]
        if todo:
            again = self.submit_evaluate(pending.weights_ref, pending.eval_layouts, np.concatenate(todo))
            again.successes, again.versions = pending.successes, pending.versions
            return self.collect_evaluate(again)
        return pending.successes, pending.versions

    @staticmethod
    def finished(call: PendingCall) -> bool:
        """Whether every actor has answered a submitted call (an answer may be an error that collect handles)."""
        receipts = [refs[0] for refs in call.refs.values()]
        return len(ray.wait(receipts, num_returns=len(receipts), timeout=0)[0]) == len(receipts)


@dataclass
class PendingEvaluation:
    """A held-out evaluation submitted to the actors (ActorPool.submit_evaluate), and what it has gathered."""

    call: PendingCall
    shares: dict[int, np.ndarray]  # actor index -> indices of its layouts
    weights_ref: ray.ObjectRef
    eval_layouts: list
    successes: np.ndarray  # (layouts,) bool, filled in as the actors answer
    versions: set[int]
