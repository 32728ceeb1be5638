"""Faults a run survives, each in real `learner.main` runs on the tests' local Ray.

The actor pool's own rules (retry, timeout, drop, minimum) are checked on small Ray actors. Then one undisturbed run
is the reference for two disturbed ones, which must end with exactly its env steps, returns, losses and final
weights, because a retried rollout repeats the dead attempt's samples and a restarted learner redoes its iterations
from the checkpoint:

- a schedule of one fault of each kind, each counted once: the learner killed before any checkpoint (it restarts from
  the run's start while the actors hold newer versions), a rollout actor killed, one wedged (SIGSTOP), the learner
  wedged, then a bug in the driver that ends the launch, whose completed iterations are saved first; --resume goes on;
- a chaos run: rollout actors killed every few iterations, the learner killed after a checkpoint and again in the
  middle of an update, and the disk full at a checkpoint (the run stops, --resume goes on). Its schedule is drawn from
  a fixed seed: which iteration each fault follows, and which actor it hits.

Rollout actors and the learner are signalled from outside once the run has logged the fault's iteration; the mid-update
kill and the full disk happen inside the learner's process (tests.helpers.fault_injection), at moments a signal cannot
choose. NaN rollbacks are in tests/integration/test_learner.py; broken envs in tests/integration/test_bad_input.py.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import ray
from ray._private import state
from ray.exceptions import OwnerDiedError

from learner.files.run_dir import RunDirectory
from learner.main import main
from learner.runtime.actor_pool import ActorPool
from learner.runtime.failures import ActorsExhaustedError, LearnerDiedError
from tests.conftest import tiny_config, tiny_run
from tests.helpers import fault_injection
from tests.helpers.flaky_actor import Flaky, Owner
from tests.helpers.runs import assert_same_run, rows_by_iteration, undisturbed_run

pytestmark = pytest.mark.usefixtures("local_ray")

# ---------------------------------------------------------------------------------------------- the actor pool


def pool_of(tmp_path: Path, modes: list[str], seconds: float = 0.0, **faults: float) -> ActorPool:
    tmp_path.mkdir(exist_ok=True)
    config = tiny_config(tmp_path, **{f"actors.faults.{k}": v for k, v in faults.items()}, **{"actors.num_actors": len(modes)})
    remote = ray.remote(Flaky)
    pool = ActorPool(config, lambda i: remote.options(num_cpus=0, max_restarts=config.actors.faults.max_restarts).remote(
        str(tmp_path / f"marker{i}"), modes[i], seconds))  # fmt: skip
    pool.wait_started()  # start-up is not part of a call's time
    return pool


def test_dead_and_wedged_actors_are_restarted_and_their_calls_retried(tmp_path) -> None:
    # The hanging call costs the deadline; the restarted actor must answer within it too, and Ray can take seconds on a
    # busy machine to deliver the first calls to a restarted actor: a deadline well above that.
    pool = pool_of(tmp_path, ["die", "hang", "ok"], call_timeout_s=20)
    results = pool.call(Flaky.work, lambda i: (10 * (i + 1),))
    assert {i: ray.get(refs[0])["env_steps"] for i, refs in results.items()} == {0: 10, 1: 20, 2: 30}
    assert pool.restarts == {0: 1, 1: 1, 2: 0}
    assert pool.faults["faults/actor_timeouts"] == 1 and pool.faults["faults/actor_restarts"] == 2
    assert pool.faults["faults/resampled_env_steps"] == 30  # the retried calls' work, counted once each


def test_a_restarted_actors_start_up_and_its_call_each_have_the_whole_deadline(tmp_path) -> None:
    """An actor that takes 3 s to start again and 3 s to answer, under a 5 s deadline: 6 s in all, but each within its
    own deadline, so it is restarted once and never timed out (a VLA actor reloading its model on a short deadline)."""
    pool = pool_of(tmp_path, ["slow_restart"], seconds=3.0, call_timeout_s=5)
    results = pool.call(Flaky.work, lambda i: (7,))
    assert {i: ray.get(refs[0])["env_steps"] for i, refs in results.items()} == {0: 7}
    assert pool.restarts == {0: 1} and pool.faults["faults/actor_timeouts"] == 0


def test_a_call_of_several_pieces_of_work_has_the_deadline_once_per_piece(tmp_path) -> None:
    """A 3 s call under a 2 s deadline: given two deadlines (a held-out evaluation of two groups of episodes) it is
    answered and never timed out; given one, it is taken for a wedged actor and killed."""
    pool = pool_of(tmp_path / "a", ["slow"], seconds=3.0, call_timeout_s=2)
    results = pool.call(Flaky.work, lambda i: (5,), allowances={0: 2})
    assert {i: ray.get(refs[0])["env_steps"] for i, refs in results.items()} == {0: 5}
    assert pool.faults["faults/actor_timeouts"] == 0 and pool.restarts == {0: 0}
    once = pool_of(tmp_path / "b", ["slow"], seconds=3.0, call_timeout_s=2, max_restarts=0)
    with pytest.raises(ActorsExhaustedError, match="rollout actor 0 died"):
        once.call(Flaky.work, lambda i: (5,))
    assert once.faults["faults/actor_timeouts"] == 1


def test_an_actor_out_of_restarts_is_dropped_until_too_few_are_left(tmp_path) -> None:
    pool = pool_of(tmp_path / "a", ["die", "ok"], max_restarts=0)
    dropped = r"rollout actor 0 died \(ActorDiedError\) with its 0 restarts spent .*: dropped; training goes on with the 1 left"
    with pytest.warns(RuntimeWarning, match=dropped):
        results = pool.call(Flaky.work, lambda i: (1,))
    assert list(results) == [1] and list(pool.actors) == [1] and pool.faults["faults/dropped_actors"] == 1
    strict = pool_of(tmp_path / "b", ["die", "ok"], max_restarts=0, min_alive=2)
    with pytest.raises(ActorsExhaustedError, match="1 left, below actors.faults.min_alive=2"):
        strict.call(Flaky.work, lambda i: (1,))


def test_a_call_whose_weights_owner_died_reports_the_learner_dead(tmp_path) -> None:
    """The weights a rollout call names are owned by the learner that put them: once it dies, the call cannot get
    them, and the driver must restart the learner (which publishes them again), not fail the run."""
    pool = pool_of(tmp_path, ["ok", "ok"])
    owner = ray.remote(Owner).options(num_cpus=0).remote()
    (weights,) = ray.get(owner.put.remote(10**7))  # the size of small weights, so not inlined into the reply
    ray.kill(owner)
    with pytest.raises(OwnerDiedError):  # once Ray knows the owner is gone (until then a copy may still be read)
        while True:
            ray.get(weights, timeout=60)
            time.sleep(0.05)
    with pytest.raises(LearnerDiedError, match="the learner that published the weights of rollout actor 0's work call died"):
        pool.call(Flaky.work, lambda i: (weights,))


# ---------------------------------------------------------------------------------------------- real runs

ITERATIONS = 24
# 4 optimiser steps an iteration, checkpoints every 5 iterations (a learner death redoes up to 4), restarts enough for
# every fault of a schedule, and a call deadline (a restarted actor's start-up has one of its own) that a rollout
# finishes within on two cores busy with other work too. Only fault knobs differ between the runs, so all of them must give the same bits.
SETTINGS = {"iterations": ITERATIONS, "actors.decisions_per_rollout": 16, "env.max_episode_steps": 60, "algorithm.minibatch_size": 32,
            "checkpoint_every": 5, "actors.faults.max_restarts": 30, "actors.faults.call_timeout_s": 30,
            "learner.faults.max_restarts": 3}  # fmt: skip


def logged_iterations(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return max((json.loads(line)["iteration"] for line in path.read_text().splitlines() if line.endswith("}")), default=0) \
        if path.is_file() else 0  # fmt: skip


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory, bc_checkpoint, fault_plan) -> Path:
    return undisturbed_run(tmp_path_factory.mktemp("undisturbed") / "run", bc_checkpoint, fault_plan, SETTINGS)


@dataclass
class Signals:
    """Faults sent from outside, each once the run has logged its iteration: (iteration, kind, victim's draw), kind one
    of "kill learner", "wedge learner", "kill rollout actor", "wedge rollout actor"."""

    planned: list[tuple[int, str, float]]
    sent: list[dict] = field(default_factory=list)

    def send_during(self, run_dir: Path, stop: threading.Event) -> threading.Thread:
        """Send them in order, each once the run has logged its iteration and its target is alive. The actors are told
        apart by their Ray actor ids (a restart keeps the id), so a victim's draw picks the same actor every time."""
        stopped: set[int] = set()

        def alive(actor_class: str) -> list[int]:
            table = sorted(state.actors().items())
            return [a["Pid"] for _, a in table if a["ActorClassName"] == actor_class and a["State"] == "ALIVE" and a["Pid"] not in stopped]

        def act() -> None:
            for iteration, kind, draw in self.planned:
                while not stop.is_set():
                    pids = alive("LearnerActor" if kind.endswith("learner") else "RolloutActor")
                    if logged_iterations(run_dir) >= iteration and pids:
                        pid = pids[int(draw * len(pids))]
                        wedge = kind.startswith("wedge")
                        os.kill(pid, signal.SIGSTOP if wedge else signal.SIGKILL)
                        stopped.update([pid] if wedge else [])
                        self.sent.append({"kind": kind, "after_iteration": iteration, "pid": pid})
                        break
                    time.sleep(0.02)

        thread = threading.Thread(target=act, daemon=True)
        thread.start()
        return thread


def test_the_summary_reports_what_the_run_held_for_how_long_and_where_its_start_went(undisturbed) -> None:
    from learner.runtime.startup import STARTUP_STAGES

    summary, last_row = json.loads((undisturbed / "summary.json").read_text()), rows_by_iteration(undisturbed)[ITERATIONS]
    cost = summary["cost"]
    # On the 2-CPU local Ray: the learner holds 0.5 CPU and each of the 2 actors (2 - 0.5) / 2, for the whole run.
    assert cost["cpu_seconds_reserved"] == pytest.approx(2.0 * cost["wall_seconds"], rel=1e-9)
    assert cost["gpu_seconds_reserved"] == 0.0 and cost["env_steps"] == last_row["rollout/total_env_steps"]
    assert 0 < last_row["cost/wall_seconds"] <= cost["wall_seconds"]
    assert 0.0 <= last_row["rollout/state_beyond_clip"] <= 1.0  # how often the policy clipped a state (an export reports it)
    # Every stage, once, in seconds since the run began; what needs another stage comes after it.
    startup = summary["startup"]
    assert list(startup) == sorted(startup, key=startup.get) and set(startup) == set(STARTUP_STAGES)
    assert 0 < startup["actors_ready"] <= startup["weights_published"] < startup["initial_evaluation"]
    assert startup["input_checked"] <= startup["actors_ready"] and startup["learner_ready"] <= startup["weights_published"]
    assert startup["ray_up"] <= startup["initial_policy"] <= startup["learner_ready"]  # the learner starts from it
    assert startup["initial_evaluation"] < startup["first_rollout"] < cost["wall_seconds"]


DRIVER_BUG_AFTER = 17  # the iteration whose console line raises, in a launch that checkpoints every 5


def test_a_run_survives_one_fault_of_each_kind_counted_once_with_the_undisturbed_results(
    tmp_path, bc_checkpoint, undisturbed, fault_plan, monkeypatch, capsys
) -> None:
    from learner.runtime import reporting

    fault_injection.arm(fault_plan)
    run_dir = tmp_path / "run"
    # A 20 s learner deadline: far above a tiny update, so only the stopped learner misses it.
    argv = tiny_run(run_dir, bc_checkpoint, **SETTINGS, **{"learner.faults.call_timeout_s": 20})
    signals = Signals(
        [(2, "kill learner", 0.0), (6, "kill rollout actor", 0.0), (9, "wedge rollout actor", 0.7), (12, "wedge learner", 0.0)]
    )
    console_line = reporting.console_line

    def buggy_console_line(metrics):
        if metrics["iteration"] == DRIVER_BUG_AFTER:
            raise RuntimeError("a bug in the driver")
        return console_line(metrics)

    monkeypatch.setattr(reporting, "console_line", buggy_console_line)
    capsys.readouterr()
    stop = threading.Event()
    sender = signals.send_during(run_dir, stop)
    try:
        with pytest.raises(RuntimeError, match="a bug in the driver"):
            main(argv)
    finally:
        stop.set()
        sender.join(timeout=5)
    out = capsys.readouterr().out
    assert [event["kind"] for event in signals.sent] == [kind for _, kind, _ in signals.planned]
    for fault in (
        r"the learner died",
        r"rollout actor \d wedged \(no answer to \w+ within actors\.faults\.call_timeout_s=30s\): killing it",
        r"rollout actor \d restarted",
        r"the learner wedged \(no answer to \w+ within [\d.]+s \(learner\.faults\.call_timeout_s, .*\); killed\)",
    ):
        assert re.search(rf"\[fault\] {fault}", out), (fault, out)
    # The completed iterations were saved before the error went up (no periodic checkpoint falls on iteration 17).
    directory = RunDirectory(run_dir)
    assert directory.latest_checkpoint().name == f"iter_{DRIVER_BUG_AFTER:06d}"  # loadable: checked file by file
    first_launch = rows_by_iteration(run_dir)[DRIVER_BUG_AFTER]  # logged before its console line failed
    assert (first_launch["faults/learner_restarts"], first_launch["faults/actor_restarts"], first_launch["faults/actor_timeouts"],
            first_launch["faults/dropped_actors"]) == (2, 2, 1, 0)  # fmt: skip
    assert first_launch["faults/resampled_env_steps"] > 0  # the retried calls' samples, taken again

    monkeypatch.undo()
    # The resumed launch loses its final evaluation with its learner, which is started again for it.
    killed = kill_the_learner_while_the_final_evaluation_fetches_its_weights(monkeypatch)
    assert main(argv + ["--resume"]) == 0
    assert killed
    assert_same_run(run_dir, undisturbed, ITERATIONS)  # nothing lost, nothing counted twice
    final, undisturbed_final = rows_by_iteration(run_dir)[ITERATIONS], rows_by_iteration(undisturbed)[ITERATIONS]
    assert {k: v for k, v in final.items() if k.startswith("eval/") and k != "eval/wait_seconds"} == {
        k: v for k, v in undisturbed_final.items() if k.startswith("eval/") and k != "eval/wait_seconds"}  # fmt: skip
    out = capsys.readouterr().out
    assert re.search(r"\[fault\] the learner died .*: restarting it \(1/3\) from .*iter_000024", out), out
    assert f"[eval:iteration {ITERATIONS}, again] held-out" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["env_steps"] == undisturbed_final["rollout/total_env_steps"]
    assert summary["faults"]["faults/learner_restarts"] == 1.0  # the resumed launch's own
    assert 1.0 <= summary["faults"]["faults/actor_restarts"] <= 2.0  # an actor whose retry finds the weights gone stops the wait


def kill_the_learner_while_the_final_evaluation_fetches_its_weights(monkeypatch) -> list[int]:
    """At the final checkpoint, with the final evaluation (submitted just before) under way on the actors: the rollout
    actors are killed (so that their restarts fetch the evaluation's weights again), then, once the checkpoint is
    written, the learner that owns those weights, until Ray sees it dead. Returns the killed pids."""
    from learner.runtime.learner_handle import LearnerHandle

    real_save, killed = LearnerHandle.save, []

    def pids(actor_class: str) -> list[int]:
        return [a["Pid"] for a in state.actors().values() if a["ActorClassName"] == actor_class and a["State"] == "ALIVE"]

    def save(self: LearnerHandle, iteration: int) -> None:
        final = iteration == ITERATIONS and not killed
        for pid in pids("RolloutActor") if final else []:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        real_save(self, iteration)
        if final:
            killed.extend(pids("LearnerActor"))
            os.kill(killed[-1], signal.SIGKILL)
            while killed[-1] in pids("LearnerActor"):
                time.sleep(0.05)

    monkeypatch.setattr(LearnerHandle, "save", save)
    return killed


CHAOS_SEED = 20240611
FULL_DISK_AT = 15  # the checkpoint whose write finds the disk full: the first launch ends there, --resume goes on from 10


def draw_chaos(seed: int) -> tuple[Signals, int]:
    """The chaos run's signals, and the iteration whose update the learner dies in (from inside, fault_injection)."""
    rng = random.Random(seed)
    planned, iteration = [], rng.randint(2, 4)
    while iteration < ITERATIONS - 2:
        planned.append((iteration, "kill rollout actor", rng.random()))
        iteration += rng.randint(4, 6)
    planned.append((rng.randint(6, 9), "kill learner", 0.0))  # after the checkpoint of iteration 5
    return Signals(sorted(planned)), rng.randint(17, 22)


@pytest.mark.timeout(1200)  # two launches of 24 iterations with their restarts
def test_a_run_through_many_faults_ends_with_the_undisturbed_results_bit_for_bit(tmp_path, bc_checkpoint, undisturbed, fault_plan,
                                                                                  capsys) -> None:  # fmt: skip
    run_dir = tmp_path / "chaos"
    want = rows_by_iteration(undisturbed)
    signals, mid_update_iteration = draw_chaos(CHAOS_SEED)
    steps_before = sum(int(want[i]["ppo/optimizer_steps"]) for i in range(1, mid_update_iteration))
    assert int(want[mid_update_iteration]["ppo/optimizer_steps"]) > 2  # so that step 2 is in the middle
    argv = tiny_run(run_dir, bc_checkpoint, **SETTINGS)
    capsys.readouterr()

    started = time.perf_counter()
    stop = threading.Event()
    sender = signals.send_during(run_dir, stop)
    try:
        # The first launch: the disk is full when iteration 15's checkpoint is written.
        fault_injection.arm(fault_plan, full_disk_for=(f"iter_{FULL_DISK_AT:06d}",))
        assert main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert "Traceback" not in err and err.splitlines()[-1] == (
            f"error: could not write {run_dir}/checkpoints/iter_{FULL_DISK_AT:06d}: No space left on device (trainer_state.pt); "
            "the latest checkpoint is kept: continue with --resume"), err  # fmt: skip
        directory = RunDirectory(run_dir)
        assert sorted(p.name for p in directory.checkpoints.iterdir()) == ["iter_000005", "iter_000010", "latest"]
        assert directory.latest_checkpoint().name == "iter_000010"  # loadable: checked file by file
        first_launch = rows_by_iteration(run_dir)[FULL_DISK_AT - 1]
        # The second launch, with room on the disk again: the learner dies after its step 2 of the mid-update iteration's update.
        fault_injection.arm(fault_plan, kill_learner_at_optimizer_step=steps_before + 2)
        assert main(argv + ["--resume"]) == 0
        wall_seconds = time.perf_counter() - started
    finally:
        stop.set()
        sender.join(timeout=5)
        fault_injection.arm(fault_plan)

    assert_same_run(run_dir, undisturbed, ITERATIONS)
    kinds = [event["kind"] for event in signals.sent]
    assert len(kinds) == len(signals.planned) and kinds.count("kill learner") == 1
    summary = json.loads((run_dir / "summary.json").read_text())["faults"]
    learner_restarts = first_launch["faults/learner_restarts"] + summary["faults/learner_restarts"]
    actor_restarts = first_launch["faults/actor_restarts"] + summary["faults/actor_restarts"]
    assert learner_restarts == 2  # killed from outside in the first launch, mid-update in the second
    timeouts = first_launch["faults/actor_timeouts"] + summary["faults/actor_timeouts"]
    assert summary["faults/dropped_actors"] == first_launch["faults/dropped_actors"] == 0
    # Every restart follows a kill or a timeout (on a loaded machine a slow call may outlast the deadline: it is killed
    # and retried as a wedged one is, and the results above hold all the same); a kill while an actor waits between
    # calls is never seen (its next call finds it restarted): at most one each.
    assert 1 <= actor_restarts <= kinds.count("kill rollout actor") + timeouts
    resampled = first_launch["faults/resampled_env_steps"] + summary["faults/resampled_env_steps"]
    with capsys.disabled():  # the figures docs/faults.md quotes (pytest -s shows them)
        print(json.dumps({"faults injected": {kind: kinds.count(kind) for kind in dict.fromkeys(kinds)} | {
            "learner killed mid-update": 1, "full disk at a checkpoint": 1}, "learner restarts": learner_restarts,
            "rollout actor restarts seen": actor_restarts, "rollout actor timeouts": timeouts,
            "env steps resampled by retried calls": resampled, "wall seconds (two launches)": round(wall_seconds, 1),
            "schedule": signals.sent, "mid-update kill after optimiser step": steps_before + 2}, indent=1), flush=True)  # fmt: skip


class DriverKilled(BaseException):
    """The driver's process gone at once: nothing of its own stop runs (see the test below)."""


def test_a_row_a_checkpoint_passed_unlogged_is_logged_after_the_driver_dies(tmp_path, bc_checkpoint, monkeypatch, capsys) -> None:
    """The driver dies right after the checkpoint of iteration 2, whose row still waits for its held-out evaluation; a
    death skips the driver's stop, so here its writing of the held rows and the learner's last save do nothing. The resume
    goes on from that checkpoint, so iteration 2 is never redone: its row comes from held_rows.json, without the
    evaluation that never finished, and the log holds every iteration once."""
    from learner.runtime.learner_handle import LearnerHandle
    from learner.runtime.reporting import Evaluator, MetricsRows

    real_save = LearnerHandle.save

    def save_then_die(self: LearnerHandle, iteration: int) -> None:
        real_save(self, iteration)
        if iteration == 2:
            raise DriverKilled

    monkeypatch.setattr(LearnerHandle, "save", save_then_die)
    monkeypatch.setattr(Evaluator, "finished", lambda self, evaluation: False)  # still running until waited for
    monkeypatch.setattr(MetricsRows, "keep_completed", lambda self: None)
    monkeypatch.setattr(LearnerHandle, "save_progress", lambda self, error: None)
    run_dir = tmp_path / "run"
    argv = tiny_run(run_dir, bc_checkpoint, iterations=3, eval_every=2, checkpoint_every=2)
    with pytest.raises(DriverKilled):
        main(argv)
    assert sorted(rows_by_iteration(run_dir)) == [1] and (run_dir / "held_rows.json").is_file()
    monkeypatch.undo()

    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    assert "[resume] logged iteration 2 as the last launch held it when it stopped" in capsys.readouterr().out
    rows = rows_by_iteration(run_dir)
    assert sorted(rows) == [1, 2, 3]
    assert "eval/success_rate" not in rows[2] and rows[2]["losses/pg_loss"] is not None
    assert rows[3]["eval/success_rate"] is not None  # the resumed launch's evaluations are waited for as ever
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3 and not (run_dir / "held_rows.json").exists()
