"""The tiny SmolVLA end to end on the tests' local Ray: two actors send frames and instruction tokens, the learner
updates with the ratio check, and the frozen VLM stays bit-identical."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from learner.main import main
from tests.conftest import tiny_run
from tests.helpers.vla import SMOLVLA_TINY_CONFIG, TINY_VLA_RUN

pytestmark = pytest.mark.usefixtures("local_ray")


def test_two_actor_iteration_on_local_ray_with_frames_and_instruction(tmp_path) -> None:
    """From the tiny SmolVLA's seeded initialisation (what is checked is the loop, not the learning)."""
    run_dir = tmp_path / "run"
    assert main(tiny_run(run_dir, None, "--allow-random-init", config_file=SMOLVLA_TINY_CONFIG, **TINY_VLA_RUN)) == 0
    (row,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert row["ppo/first_minibatch_ratio_dev"] <= 1e-5 and row["rollout/weight_version"] == 0
    assert row["logprob/behaviour_gap_max"] < 1e-4 and row["rollout/env_steps"] == 2 * 4 * 4
    before = load_file(str(run_dir / "checkpoints" / "random_init" / "model.safetensors"))
    after = load_file(str(run_dir / "checkpoints" / "iter_000001" / "model.safetensors"))
    changed = {k for k in before if not np.array_equal(before[k], after[k])}
    assert any(k.startswith("vla.model.action_out_proj") for k in changed) and any(k.startswith("critic_head") for k in changed)
    assert not any(".vlm." in k or k.startswith("vla.model.state_proj") for k in changed)  # the frozen VLM is bit-identical
