"""Running bench/ scripts at their smallest sizes in tests: the output they print, and the checks on its figures."""

from __future__ import annotations

import json
import math

from bench.report import flatten
from tests.conftest import TINY_RUN, overrides

# learner.main's arguments for a bench: the small run with a random policy and a few decisions, so that the start-up is
# the cost, not the work. The bench itself sets the actors, iterations and evaluation.
BENCH_SETS = ("actors.num_actors", "iterations", "eval_every", "eval_episodes")
TINY_MAIN_ARGS = ["--allow-random-init"] + [f"--set={item}" for item in overrides({
    **{name: value for name, value in TINY_RUN.items() if name not in BENCH_SETS}, "actors.decisions_per_rollout": 3,
    "env.max_episode_steps": 20, "algorithm.minibatch_size": 6, "algorithm.update_epochs": 1, "policy.hidden_dim": 32,
    "policy.num_layers": 1, "checkpoint_every": 100,
})]  # fmt: skip


def printed(capsys) -> dict:
    """The JSON object a bench printed, checked against its `name: value` lines."""
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    results = json.loads(next(line for line in lines if line.startswith("{")))
    named = dict(line.split(": ", 1) for line in lines if not line.startswith("{"))
    flat = flatten(results)
    assert set(named) == set(flat)
    for name, value in flat.items():
        assert named[name] == str(value), name
    return results


def assert_positive(*values: float) -> None:
    for value in values:
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, value
