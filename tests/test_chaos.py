"""Many faults in one run: rollout actors killed every few iterations, one wedged, the learner killed after a
checkpoint and again in the middle of an update, and the disk full at a checkpoint (the run stops, --resume goes on).
The run must end with exactly the undisturbed run's env steps, returns, losses and final weights.

The schedule is drawn from a fixed seed: which iteration each fault follows, and which actor it hits. Rollout actors
and the learner are signalled from outside once the run has logged the fault's iteration; the mid-update kill and
the full disk happen inside the learner's process (tests.fault_injection), at moments a signal cannot choose.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import ray
from ray._private import state

from common.metrics import MetricsLog
from learner.main import main
from learner.run_dir import RunDirectory
from tests import fault_injection
from tests.test_faults import COMPARED, run_args

ITERATIONS = 40
CHAOS_SEED = 20240611
# Half the decisions of tests.test_faults' runs (4 optimiser steps an iteration), checkpoints every 5 iterations (a
# learner death redoes up to 4), restarts enough for every fault of the schedule, and a call deadline that lets a
# restarted actor start, and a call finish, on two cores busy with other work too.
SETTINGS = ["--iterations", str(ITERATIONS), "--set", "actors.decisions_per_rollout=16", "--set", "algorithm.minibatch_size=32",
            "--set", "checkpoint_every=5", "--set", "actors.max_restarts=30", "--set", "actors.call_timeout_s=60",
            "--set", "learner.max_restarts=3"]  # fmt: skip
FULL_DISK_AT = 20  # the checkpoint whose write finds the disk full: the first launch ends there, --resume goes on from 15


@pytest.fixture(scope="module")
def fault_plan(tmp_path_factory):
    """A local Ray whose workers carry tests.fault_injection; yields the plan file that arms it."""
    plan = tmp_path_factory.mktemp("faults") / "plan.json"
    ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=fault_injection.runtime_env(plan))
    yield plan
    ray.shutdown()


@dataclass
class Schedule:
    """Faults signalled from outside, each once the run has logged `iteration`: (iteration, kind, victim's draw)."""

    signals: list[tuple[int, str, float]]
    mid_update_iteration: int  # the iteration whose update the learner dies in (from inside, tests.fault_injection)
    injected: list[dict] = field(default_factory=list)


def draw_schedule(seed: int) -> Schedule:
    rng = random.Random(seed)
    signals, iteration = [], rng.randint(2, 4)
    while iteration < ITERATIONS - 2:
        signals.append((iteration, "kill rollout actor", rng.random()))
        iteration += rng.randint(4, 6)
    signals.append((rng.randint(6, 14), "kill learner", 0.0))  # after the checkpoint of iteration 5 or 10
    signals.append((rng.randint(22, 33), "wedge rollout actor", rng.random()))  # with iterations after it to notice
    return Schedule(sorted(signals), mid_update_iteration=rng.randint(26, 34))


def logged_iterations(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return max((json.loads(line)["iteration"] for line in path.read_text().splitlines() if line.endswith("}")), default=0) \
        if path.is_file() else 0  # fmt: skip


def inject_signals(run_dir: Path, schedule: Schedule, stop: threading.Event) -> threading.Thread:
    """Send the schedule's signals, each once the run has logged its iteration and its target is alive. The actors are
    told apart by their Ray actor ids (a restart keeps the id), so the victim's draw picks the same actor every time."""
    stopped: set[int] = set()

    def alive(actor_class: str) -> list[int]:
        table = sorted(state.actors().items())
        return [a["Pid"] for _, a in table if a["ActorClassName"] == actor_class and a["State"] == "ALIVE" and a["Pid"] not in stopped]

    def act() -> None:
        for iteration, kind, draw in schedule.signals:
            while not stop.is_set():
                pids = alive("LearnerActor" if kind == "kill learner" else "RolloutActor")
                if logged_iterations(run_dir) >= iteration and pids:
                    pid = pids[int(draw * len(pids))]
                    os.kill(pid, signal.SIGSTOP if kind.startswith("wedge") else signal.SIGKILL)
                    stopped.update([pid] if kind.startswith("wedge") else [])
                    schedule.injected.append({"kind": kind, "after_iteration": iteration, "pid": pid})
                    break
                time.sleep(0.02)

    thread = threading.Thread(target=act, daemon=True)
    thread.start()
    return thread


def rows_by_iteration(run_dir: Path) -> dict[int, dict]:
    return {int(row["iteration"]): row for row in MetricsLog(run_dir / "metrics.jsonl").read()}


@pytest.mark.slow
@pytest.mark.timeout(1200)  # three launches of 40 iterations with their restarts: about 4 minutes on two idle cores
def test_a_run_through_many_faults_ends_with_the_undisturbed_results_bit_for_bit(tmp_path, bc_checkpoint, fault_plan, capsys) -> None:
    reference, run_dir = tmp_path / "undisturbed", tmp_path / "chaos"
    fault_injection.arm(fault_plan)
    assert main(run_args(reference, bc_checkpoint, *SETTINGS)) == 0
    want = rows_by_iteration(reference)
    schedule = draw_schedule(CHAOS_SEED)
    steps_before = sum(int(want[i]["ppo/optimizer_steps"]) for i in range(1, schedule.mid_update_iteration))
    assert int(want[schedule.mid_update_iteration]["ppo/optimizer_steps"]) > 2  # so that step 2 is in the middle
    capsys.readouterr()

    started = time.perf_counter()
    stop = threading.Event()
    injector = inject_signals(run_dir, schedule, stop)
    try:
        # The first launch: the disk is full when iteration 20's checkpoint is written.
        fault_injection.arm(fault_plan, full_disk_for=(f"iter_{FULL_DISK_AT:06d}",))
        assert main(run_args(run_dir, bc_checkpoint, *SETTINGS)) == 1
        err = capsys.readouterr().err.strip()
        assert "Traceback" not in err and err.splitlines()[-1] == (
            f"error: could not write {run_dir}/checkpoints/iter_{FULL_DISK_AT:06d}: No space left on device (trainer_state.pt); "
            "the latest checkpoint is kept: continue with --resume"), err  # fmt: skip
        directory = RunDirectory(run_dir)
        assert sorted(p.name for p in directory.checkpoints.iterdir()) == ["iter_000005", "iter_000010", "iter_000015", "latest"]
        assert directory.latest_checkpoint().name == "iter_000015"  # loadable: checked file by file
        first_launch = rows_by_iteration(run_dir)[FULL_DISK_AT - 1]
        # The second launch, with room on the disk again: the learner dies after its step 2 of the mid-update iteration's update.
        fault_injection.arm(fault_plan, kill_learner_at_optimizer_step=steps_before + 2)
        assert main(run_args(run_dir, bc_checkpoint, *SETTINGS, "--resume")) == 0
        wall_seconds = time.perf_counter() - started
    finally:
        stop.set()
        injector.join(timeout=5)

    got = rows_by_iteration(run_dir)
    assert sorted(got) == sorted(want) == list(range(1, ITERATIONS + 1))
    for iteration, row in want.items():
        assert {k: got[iteration][k] for k in COMPARED} == {k: row[k] for k in COMPARED}, f"iteration {iteration} differs"
    final = f"checkpoints/iter_{ITERATIONS:06d}/model.safetensors"
    assert (run_dir / final).read_bytes() == (reference / final).read_bytes(), "final weights differ from the undisturbed run's"

    kinds = [event["kind"] for event in schedule.injected]
    assert len(kinds) == len(schedule.signals) and kinds.count("kill learner") == kinds.count("wedge rollout actor") == 1
    summary = json.loads((run_dir / "summary.json").read_text())["faults"]
    learner_restarts = first_launch["faults/learner_restarts"] + summary["faults/learner_restarts"]
    actor_restarts = first_launch["faults/actor_restarts"] + summary["faults/actor_restarts"]
    assert learner_restarts == 2  # killed from outside in the first launch, mid-update in the second
    timeouts = first_launch["faults/actor_timeouts"] + summary["faults/actor_timeouts"]
    # The wedged actor's call times out in the second launch. On a loaded machine a slow call may outlast the deadline
    # too: it is killed and retried as the wedged one is, and the results above hold all the same.
    assert summary["faults/actor_timeouts"] >= 1 and summary["faults/dropped_actors"] == first_launch["faults/dropped_actors"] == 0
    # Every restart follows a kill or a timeout; a kill while an actor waits between calls is never seen (its next call
    # finds it restarted): at most one each.
    assert 1 <= actor_restarts <= kinds.count("kill rollout actor") + timeouts
    resampled = first_launch["faults/resampled_env_steps"] + summary["faults/resampled_env_steps"]
    with capsys.disabled():  # the figures docs/faults.md quotes (pytest -s shows them)
        print(json.dumps({"faults injected": {kind: kinds.count(kind) for kind in dict.fromkeys(kinds)} | {
            "learner killed mid-update": 1, "full disk at a checkpoint": 1}, "learner restarts": learner_restarts,
            "rollout actor restarts seen": actor_restarts, "rollout actor timeouts": timeouts,
            "env steps resampled by retried calls": resampled, "wall seconds (two launches)": round(wall_seconds, 1),
            "schedule": schedule.injected, "mid-update kill after optimiser step": steps_before + 2}, indent=1), flush=True)  # fmt: skip
