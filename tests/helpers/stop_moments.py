"""`python -m learner.main` stopped by SIGTERM at a chosen moment of the driver's loop, on the path a user's run takes:
the command in a process of its own, starting its own local Ray.

    python -m tests.helpers.stop_moments MOMENT REPORT [learner.main's arguments]

MOMENT is `rollout`, `update` or `evaluation`, as `MOMENT:N` for the driver's Nth wait on it, and `MOMENT:N:save` for a
second SIGTERM once the stopped run is saving its checkpoint. The worker that answers that wait (a rollout actor, the
learner) takes SLOW_S longer over it, and a thread of the driver sends the process SIGTERM DELAY_S into the wait: the
signal arrives inside Ray's own wait (ray.get / ray.wait), as a scheduler's would. REPORT (JSON) says, for each signal,
whether its wait was still going and what the wait raised, so that a test knows where it stopped the run.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

DELAY_S, SLOW_S = 0.2, 2.0
MOMENT_ENV = "FLOWRL_TEST_STOP_MOMENT"

# By moment: the driver's wait and the worker's call it waits on, each (module, class, method).
ROLLOUT_ACTOR, LEARNER_ACTOR = ("actors.rollout_actor", "RolloutActor"), ("learner.runtime.learner_actor", "LearnerActor")
WAITS = {
    "rollout": (("learner.runtime.actor_pool", "ActorPool", "collect_sample"), (*ROLLOUT_ACTOR, "sample_with_receipt")),
    "update": (("learner.runtime.learner_handle", "LearnerHandle", "update"), (*LEARNER_ACTOR, "update")),
    "evaluation": (("learner.runtime.reporting", "Evaluator", "collect"), (*ROLLOUT_ACTOR, "evaluate")),
    "save": (("learner.runtime.learner_handle", "LearnerHandle", "save"), (*LEARNER_ACTOR, "save")),
}


def parse(moment: str) -> list[tuple[str, int]]:
    """`rollout:2:save` -> [("rollout", 2), ("save", 1)]: each wait stopped at, with its call number."""
    name, *rest = moment.split(":")
    stops = [(name, int(rest[0]) if rest else 1)]
    return stops + ([("save", 1)] if rest[1:] == ["save"] else [])


def wrap_nth_call(where: tuple[str, str, str], nth: int, around: Any) -> None:
    """The `nth` call of the method `where` names runs inside the context manager `around()`; the others as they were."""
    module_name, class_name, method_name = where
    owner = getattr(__import__(module_name, fromlist=[class_name]), class_name)
    method, calls = getattr(owner, method_name), []

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) != nth:
            return method(*args, **kwargs)
        with around():
            return method(*args, **kwargs)

    setattr(owner, method_name, wrapped)


def slow_workers() -> None:
    """Ray's worker_process_setup_hook: in each worker, the stopped calls take SLOW_S longer."""

    class Slower:
        def __enter__(self) -> None:
            time.sleep(SLOW_S)

        def __exit__(self, *exc: object) -> None:
            return None

    for name, nth in parse(os.environ[MOMENT_ENV]):
        wrap_nth_call(WAITS[name][1], nth, Slower)


def stop_inside(name: str, nth: int, report: dict[str, Any]) -> None:
    """SIGTERM to this process DELAY_S into the driver's `nth` wait of moment `name`; report[name] what it found."""

    class Stopping:
        def __enter__(self) -> None:
            self.going = True
            threading.Timer(DELAY_S, self.stop).start()

        def stop(self) -> None:
            report[name] = {"going": self.going, "raised": None}
            os.kill(os.getpid(), signal.SIGTERM)

        def __exit__(self, kind: type | None, *exc: object) -> None:
            self.going = False
            if name in report:
                report[name]["raised"] = kind and kind.__name__

    wrap_nth_call(WAITS[name][0], nth, Stopping)


def main(argv: list[str]) -> int:
    moment, report_path, *command = argv
    report: dict[str, Any] = {}
    for name, nth in parse(moment):
        stop_inside(name, nth, report)
    import ray

    tree = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")]))
    workers = {"worker_process_setup_hook": "tests.helpers.stop_moments.slow_workers", "env_vars": {MOMENT_ENV: moment, "PYTHONPATH": tree}}
    ray.init = functools.partial(ray.init, runtime_env=workers)  # the run's own local Ray, its workers slowed where it stops
    from learner.main import main as learner_main

    try:
        return learner_main(command)
    finally:
        Path(report_path).write_text(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
