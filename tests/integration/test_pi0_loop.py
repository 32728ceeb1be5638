"""The tiny pi0 and pi0.5 through the project's loop pieces, in one process (lerobot 0.6 only): BC on rendered
demonstrations, a rollout actor's record with frames and instruction tokens, and one PPO iteration of the learner
with the ratio check, the behaviour log-probs reproduced, and PaliGemma left bit-identical; and bench/smolvla_gpu.py's
pi0 and pi0.5 recipes at test size."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from common.policy.lerobot_compat import LEROBOT_LINE, SUPPORTED_LEROBOT

if LEROBOT_LINE < (0, 6):
    pytest.skip(
        f"pi0 / pi0.5 need lerobot 0.6 (its pi0 on lerobot 0.4 needs a patched transformers): {SUPPORTED_LEROBOT[(0, 6)]}",
        allow_module_level=True,
    )

from actors.rollout_actor import RolloutActor  # noqa: E402
from common.policy import FlowPolicy  # noqa: E402
from common.suites.metaworld import TASKS  # noqa: E402
from learner.bc.training import pretrain  # noqa: E402
from learner.update.learner import Learner  # noqa: E402
from tests.conftest import tiny_config  # noqa: E402
from tests.helpers.vla import TINY_VLA_RUN  # noqa: E402
from tests.helpers.vla_checks import check_fused_attention_in_actor_and_learner, check_sent_image_embeddings_in_actor_and_learner  # noqa: E402


def tiny_run_config(policy_type: str, run_dir: Path, **extra: object):
    """The default run with the tiny pi0 / pi0.5 (one 32 px corner camera), one actor and the tiny VLA run's budget;
    `extra` fields on top."""
    policy = {"policy.type": policy_type, "policy.image_size": 32, "policy.chunk_size": 4, "policy.num_steps": 3, "policy.hidden_dim": 32,
              "policy.init_noise_std": 0.0, "policy.pi0.paligemma_variant": "tiny", "policy.pi0.action_expert_variant": "tiny_expert",
              "policy.pi0.image_resolution": 32, "policy.pi0.max_state_dim": 39, "policy.pi0.max_action_dim": 4,
              "policy.pi0.tokenizer_max_length": 48 if policy_type == "pi0" else 240}  # fmt: skip
    return tiny_config(run_dir.parent, **{**policy, **TINY_VLA_RUN, "actors.num_actors": 1, "run_dir": str(run_dir), **extra})


@pytest.fixture(scope="module", params=["pi0", "pi05"])
def bc(request, tmp_path_factory) -> tuple[str, Path]:
    """A policy type and its checkpoint after BC on rendered demonstrations."""
    directory = tmp_path_factory.mktemp(request.param)
    pretrain(tiny_run_config(request.param, directory / "run"), directory / "bc", progress=False)
    return request.param, directory / "bc"


def test_bc_rollout_and_one_ppo_iteration(bc, tmp_path) -> None:
    policy_type, checkpoint = bc
    config = tiny_run_config(policy_type, tmp_path / "run")
    actor = RolloutActor(config, 0, checkpoint)
    batch = actor.sample(None, 0)
    assert batch.obs.images.shape == (4, 1, 1, 32, 32, 3) and batch.obs.images.dtype == np.uint8 and batch.obs.images.std() > 10
    tokenizer = actor.policy.tokenizer
    expected = TASKS["pick-place-v3"].instruction + ("\n" if policy_type == "pi0" else "")
    assert tokenizer.decode(batch.obs.tokens[2, 0][batch.obs.token_mask[2, 0]], skip_special_tokens=True) == expected

    learner = Learner(config, FlowPolicy.from_pretrained(checkpoint))
    assert type(learner.policy).__name__ == "PiFlowPolicy" and not learner.policy.encoder_is_trainable
    before = {name: tensor.clone() for name, tensor in learner.policy.state_dict().items()}
    metrics = learner.update(batch)
    assert metrics["logprob/behaviour_gap_max"] < 1e-4 and metrics["ppo/first_minibatch_ratio_dev"] <= 1e-5
    changed = {name for name, tensor in learner.policy.state_dict().items() if not torch.equal(tensor, before[name])}
    assert any(name.startswith("vla.model.action_out_proj") for name in changed) and any(name.startswith("critic_head") for name in changed)
    trainable = {name for name, p in learner.policy.named_parameters() if p.requires_grad}
    assert changed <= trainable and not any(".paligemma." in name for name in changed)  # PaliGemma is bit-identical


def test_fused_attention_in_the_actor_and_the_learner_samples_and_trains_as_the_eager_attention_does(bc, tmp_path) -> None:
    policy_type, checkpoint = bc
    check_fused_attention_in_actor_and_learner(checkpoint, lambda field: tiny_run_config(policy_type, tmp_path / "run", **{field: True}))


def test_an_actor_sending_its_vision_tokens_gives_the_learner_the_update_its_frames_give(bc, tmp_path) -> None:
    policy_type, checkpoint = bc
    frames = tiny_run_config(policy_type, tmp_path / "run")
    sending = tiny_run_config(policy_type, tmp_path / "run", **{"actors.speed.send_image_embeddings": True})
    check_sent_image_embeddings_in_actor_and_learner(checkpoint, frames, sending, lambda policy: policy.vla.model.paligemma_with_expert)


@pytest.mark.parametrize("recipe", ["pi0_pick.yaml", "pi05_pick.yaml"])
def test_gpu_bench_runs_the_recipe_at_test_size(recipe, capsys) -> None:
    """bench/smolvla_gpu.py's path for pi0 / pi0.5 with the tiny models on CPU: the stand-in written by lerobot's
    save_pretrained loads strictly, the learner scores and updates the sampled decisions with the ratio check, the
    stages --skip names are left out, and --fused-attention times the decision again with the attention in one kernel:
    fewer ATen ops dispatched, and the eager path's chain on the same noise within the bfloat16 actor's rounding."""
    from bench import smolvla_gpu
    from bench.report import REPO_ROOT, flatten

    argv = ["--recipe", str(REPO_ROOT / "configs" / recipe), "--size", "tiny", "--rollouts", "2", "--rollout-repeats", "2",
            "--batch-sizes", "1", "--skip", "prepare,publish_load_sample_v1", "--fused-attention"]  # fmt: skip
    assert smolvla_gpu.main(argv) == 0
    results = json.loads(next(line for line in capsys.readouterr().out.splitlines() if line.startswith("{")))
    assert not [name for name in flatten(results) if name.endswith("/error")]
    assert "prepare" not in results and "publish_load_sample_v1" not in results
    assert results["build"]["trainable_parameters"] < results["build"]["parameters"]  # PaliGemma frozen
    assert results["update"]["decisions"] == 2 * 2 * 2 and results["update"]["ppo/first_minibatch_ratio_dev"] <= 1e-5
    assert 0 < results["update"]["scoring_pass_seconds"] < results["update"]["seconds"]  # the update times its own scoring pass
    assert results["decision_latency"]["eager_batch1_aten_ops"] > 1000
    assert 0 < results["decision_latency"]["eager_fused_batch1_aten_ops"] < results["decision_latency"]["eager_batch1_aten_ops"]
    assert results["decision_latency"]["eager_fused_vs_eager_batch1_max_abs_chain"] < 0.05
    # PaliGemma's SigLIP is found as the vision tower, and FLOPs are counted where they are spent
    latency, update = results["decision_latency"], results["update"]
    assert 0 < latency["batch1_vision_flops"] < latency["batch1_encode_flops"] < latency["batch1_flops"]
    assert update["ppo/actor_lr"] > 0 and 0 < update["vision_flops"] <= update["scoring_pass_flops"] < update["flops"]
