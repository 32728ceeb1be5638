"""A rollout actor films in a Ray worker that did not inherit the driver's rendering settings."""

from __future__ import annotations

import re

from tests.conftest import REPO

FILMS_ON_A_WORKER_WITHOUT_GL_SETTINGS = """
import sys
from pathlib import Path

import ray

ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)  # its workers start without MUJOCO_GL

from actors.rollout_actor import RolloutActor
from common.suites import make_suite
from learner.runtime.startup import LayoutTables
from tests.conftest import tiny_config

config = tiny_config(Path(sys.argv[2]))
suite = make_suite(config.env)  # sets MUJOCO_GL in this process only, after Ray's start
seeds = [*config.env.train_benchmark_seeds, *config.env.eval_benchmark_seeds]
tables = [ray.put(suite.layout_tables([(task, seed) for task in suite.tasks() for seed in seeds]))]
holder = ray.remote(LayoutTables).options(name="layout-tables", num_cpus=0).remote(tables)
actor = ray.remote(RolloutActor).remote(config, 0, sys.argv[1], "layout-tables")
(recording,) = ray.get(actor.record_episodes.remote(None, suite.held_out(1), 32))
print("frames", recording.frames.shape)
"""


def test_an_actor_on_a_worker_without_gl_settings_films(tmp_path, bc_checkpoint) -> None:
    """A Ray worker that did not inherit MUJOCO_GL (the driver set it after Ray had started) imports the simulator
    while it reads the run's layout tables: the actor makes its suite first, so that MuJoCo still gets EGL (under GLFW,
    with no display, creating the film camera's context aborted the actor)."""
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "MUJOCO_GL"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", FILMS_ON_A_WORKER_WITHOUT_GL_SETTINGS, str(bc_checkpoint), str(tmp_path)],
                            env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"frames \(\d+, 32, 32, 3\)", result.stdout), result.stdout
