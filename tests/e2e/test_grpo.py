"""GRPO with KL to its reference, end to end on the tests' local Ray."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from learner.files.checkpoints import REFERENCE_DIR
from learner.main import main
from tests.conftest import tiny_run

pytestmark = pytest.mark.usefixtures("local_ray")


def test_grpo_with_kl_on_local_ray_with_two_actors(tmp_path, bc_checkpoint) -> None:
    run_dir = tmp_path / "run"
    grpo = {"actors.decisions_per_rollout": 10, "env.reward": "dense", "algorithm.group_size": 2, "algorithm.kl_beta": 0.1}
    assert main(tiny_run(run_dir, bc_checkpoint, "--algo", "grpo", **grpo)) == 0

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]
    for row in rows:
        assert row["ppo/first_minibatch_ratio_dev"] <= 1e-5
        assert row["grpo/groups"] >= 2  # one complete group per actor at least: groups never span actors
        assert "losses/v_loss" not in row and np.isfinite(row["losses/kl_ref"])
    final = load_file(str(run_dir / "checkpoints" / "iter_000002" / "model.safetensors"))
    reference = load_file(str(run_dir / "checkpoints" / "iter_000002" / REFERENCE_DIR / "model.safetensors"))
    initial = load_file(str(bc_checkpoint / "model.safetensors"))
    for name, value in initial.items():
        np.testing.assert_array_equal(reference[name], value, err_msg=name)
        if name.startswith("critic_net"):
            np.testing.assert_array_equal(final[name], value, err_msg=name)  # no critic trained
    assert not np.array_equal(final["velocity_net.0.weight"], initial["velocity_net.0.weight"])
