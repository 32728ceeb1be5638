"""Faults raised from inside the Ray workers of a run, where a signal sent from outside cannot choose the moment: the
learner killed in the middle of an update, a checkpoint write that finds the disk full.

The tests' local Ray (tests/conftest.py `local_ray`) installs `install` in every worker it starts (runtime_env's
worker_process_setup_hook, `runtime_env`). Nothing happens until a test arms the plan file (`arm`): the faults are read
at each opportunity, so one Ray serves runs with different plans and runs with none, and a learner restarted after a
fault reads the same plan. A fault that must happen once leaves a marker beside the plan when it fires.
"""

from __future__ import annotations

import errno
import json
import os
import signal
from pathlib import Path
from typing import Any

PLAN_ENV = "FLOWRL_TEST_FAULT_PLAN"


def runtime_env(plan: Path) -> dict[str, Any]:
    """The ray.init runtime_env that installs the faults of `plan` in every worker. The workers import this tree's
    modules first (PYTHONPATH): a worker imports the hook before it puts its working directory on sys.path, and a
    `tests` package in site-packages (draccus installs one) would shadow this one."""
    search_path = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH")]))
    return {"worker_process_setup_hook": f"{__name__}.install", "env_vars": {PLAN_ENV: str(plan), "PYTHONPATH": search_path}}


def arm(plan: Path, *, kill_learner_at_optimizer_step: int | None = None, full_disk_for: tuple[str, ...] = ()) -> None:
    """kill_learner_at_optimizer_step: SIGKILL the learner's process right after the run's Nth optimiser step (counted by
    Adam's own step, which checkpoints keep), once. full_disk_for: the checkpoints (iter_NNNNNN) whose trainer state
    finds no space on the disk, every time they are written."""
    for marker in plan.parent.glob(f"{plan.name}.fired-*"):
        marker.unlink()
    plan.write_text(json.dumps({"kill_learner_at_optimizer_step": kill_learner_at_optimizer_step, "full_disk_for": list(full_disk_for)}))


def _plan() -> dict[str, Any]:
    path = Path(os.environ[PLAN_ENV])
    return json.loads(path.read_text()) if path.is_file() else {}


def _fire_once(name: str) -> bool:
    marker = Path(f"{os.environ[PLAN_ENV]}.fired-{name}")
    if marker.exists():
        return False
    marker.touch()
    return True


def install() -> None:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def after_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        kill_at = _plan().get("kill_learner_at_optimizer_step")
        steps = max((int(state["step"]) for state in optimizer.state.values() if "step" in state), default=0)
        if kill_at is not None and steps >= kill_at and _fire_once("learner-killed"):
            os.kill(os.getpid(), signal.SIGKILL)  # weights half-way through the update, nothing saved

    real_save = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        # A checkpoint's temp directory is .iter_NNNNNN.tmp-PID (common.policy.write_directory_atomically).
        full = _plan().get("full_disk_for", []) if isinstance(f, (str, os.PathLike)) else []
        if any(Path(f).parent.name.startswith(f".{name}.tmp-") for name in full):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        real_save(obj, f, *args, **kwargs)

    register_optimizer_step_post_hook(after_step)
    torch.save = save
