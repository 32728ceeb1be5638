"""The tiny SmolVLA through the project's loop pieces in one process: BC on rendered demonstrations (frames + instruction
+ state), rollout records with uint8 frames and instruction tokens, the learner's update with the ratio check and the
cached prefix, compiled and bfloat16 paths, several tasks under their instructions (a run on Ray:
tests/e2e/test_cluster.py, on three nodes)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from actors.rollout_actor import RolloutActor
from common.config import ConfigError
from common.diagnostics import BehaviourGapWarning
from common.flow import chain_log_prob
from common.observation import Observation
from common.policy import FlowPolicy, build_policy
from common.rollout import decide
from common.suites.metaworld import TASKS
from learner.bc.training import REPORT_FILE, pretrain
from learner.update.learner import Learner
from tests.conftest import tiny_config
from tests.helpers.vla import SMOLVLA_TINY_CONFIG, TINY_VLA_RUN
from tests.helpers.vla_checks import check_fused_attention_in_actor_and_learner, check_sent_image_embeddings_in_actor_and_learner


def tiny_run_config(run_dir: Path, *extra: str):
    """configs/smolvla_tiny_pick.yaml with the tiny VLA run's budget, and `extra` (section.field=value) over it."""
    fields = dict(item.split("=", 1) for item in extra)
    return tiny_config(run_dir.parent, SMOLVLA_TINY_CONFIG, **{**TINY_VLA_RUN, "run_dir": str(run_dir), **fields})


@pytest.fixture(scope="module")
def smolvla_bc(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("smolvla_bc") / "checkpoint"
    pretrain(tiny_run_config(out.parent / "run"), out, progress=False)
    return out


def test_bc_on_rendered_demonstrations_trains_the_encoder(smolvla_bc) -> None:
    report = json.loads((smolvla_bc / REPORT_FILE).read_text())
    assert report["frames"] == "1 camera(s) ['corner'], 32x32 uint8" and report["instruction"] == TASKS["pick-place-v3"].instruction
    assert np.isfinite(report["loss_last_100"]) and report["samples"] > 0
    trained = FlowPolicy.from_pretrained(smolvla_bc)
    assert type(trained).__name__ == "SmolVLAFlowPolicy"
    config = tiny_run_config(smolvla_bc.parent / "run")
    torch.manual_seed(config.pretrain.seed)
    untrained = build_policy(config.policy)  # the same initialisation BC started from
    vision = "vla.model.vlm_with_expert.vlm.model.vision_model.embeddings.patch_embedding.weight"
    assert not torch.equal(trained.state_dict()[vision], untrained.state_dict()[vision])  # frames reached the loss
    assert not torch.equal(trained.obs_std, torch.ones(39))  # normalised with the demonstrations' statistics
    assert torch.equal(trained.critic_head[0].weight, untrained.critic_head[0].weight)  # no BC gradient reaches the critic


def test_rollout_record_carries_frames_and_instruction_and_the_learner_reuses_the_prefix(smolvla_bc, tmp_path) -> None:
    config = tiny_run_config(tmp_path / "run")
    actor = RolloutActor(config, 0, smolvla_bc)
    batch = actor.sample(None, 0)
    assert batch.obs.images.shape == (4, 1, 1, 32, 32, 3) and batch.obs.images.dtype == np.uint8
    assert batch.bootstrap_obs.images.shape[1:] == (1, 32, 32, 3) and batch.obs.images.std() > 10  # a rendered scene, not a blank frame
    tokenizer = actor.policy.vla.model.vlm_with_expert.processor.tokenizer
    assert tokenizer.decode(batch.obs.tokens[2, 0][batch.obs.token_mask[2, 0]]) == TASKS["pick-place-v3"].instruction + "\n"
    assert batch.actor_precision == "float32 on cpu"

    learner = Learner(config, FlowPolicy.from_pretrained(smolvla_bc))
    assert not learner.policy.encoder_is_trainable
    data = learner.prepare(batch)
    assert data.features is not None  # computed once, reused by every epoch and minibatch
    assert data.metrics["logprob/behaviour_gap_max"] < 1e-4


def test_an_actor_with_compiled_steps_and_vision_samples_chains_the_learner_scores_as_its_own(smolvla_bc, tmp_path) -> None:
    """actors.speed.compile_steps and actors.speed.compile_vision: the actor's denoising steps and vision tower run compiled, and
    the learner's eager rescoring of its chains matches their behaviour log-probs within float rounding, with the
    first minibatch's ratio at 1."""
    torch._dynamo.reset()  # compiles of other tests' policies count towards the step's recompile limit
    config = tiny_run_config(tmp_path / "run", "actors.speed.compile_steps=true", "actors.speed.compile_vision=true")
    actor = RolloutActor(config, 0, smolvla_bc)
    compiled_vision, embedded = actor.policy.compiled_vision, []
    actor.policy.compiled_vision = lambda frames: embedded.append(frames.shape[0]) or compiled_vision(frames)
    compiled_before = counters["stats"]["unique_graphs"]
    batch = actor.sample(None, 0)
    assert actor.policy.compiled_step is not None and counters["stats"]["unique_graphs"] >= compiled_before + 2
    assert embedded and set(embedded) == {config.actors.envs_per_actor}  # every decision's frames, one camera
    learner = Learner(config, FlowPolicy.from_pretrained(smolvla_bc))
    assert learner.policy.compiled_step is None and learner.policy.compiled_vision is None  # the learner scores eagerly
    metrics = learner.update(batch)
    assert metrics["logprob/behaviour_gap_max"] < 1e-5 and metrics["ppo/first_minibatch_ratio_dev"] <= 1e-5


def test_a_learner_with_compiled_steps_in_one_pass_and_vision_updates_within_rounding_of_the_eager_one(smolvla_bc, tmp_path) -> None:
    """learner.speed.compile_steps with learner.speed.steps_in_one_pass, and learner.speed.compile_vision: the scoring pass encodes every
    observation through the compiled vision tower, and the K denoising steps over the cached prefix are scored and
    trained through one compiled graph per grad mode, no graph break; the ratio starts at 1 and the trained weights
    land where the eager learner's do, up to float rounding."""
    torch._dynamo.reset()  # compiles of other tests' policies count towards the step's recompile limit
    config = tiny_run_config(tmp_path / "run", "learner.speed.steps_in_one_pass=true")
    batch = RolloutActor(config, 0, smolvla_bc).sample(None, 0)
    eager = Learner(config, FlowPolicy.from_pretrained(smolvla_bc))
    compiled_sets = ("learner.speed.steps_in_one_pass=true", "learner.speed.compile_steps=true", "learner.speed.compile_vision=true")
    compiled = Learner(tiny_run_config(tmp_path / "run", *compiled_sets), FlowPolicy.from_pretrained(smolvla_bc))
    step, grad_modes = compiled.policy.compiled_step, []
    compiled.policy.compiled_step = lambda *args: grad_modes.append(torch.is_grad_enabled()) or step(*args)
    tower, embedded = compiled.policy.compiled_vision, []
    compiled.policy.compiled_vision = lambda frames: embedded.append(frames.shape[0]) or tower(frames)
    graphs, breaks = counters["stats"]["unique_graphs"], counters["graph_break"].total()
    metrics, metrics_compiled = eager.update(batch), compiled.update(batch)
    assert grad_modes == [False, True]  # the scoring pass, then the minibatch's forward (4 decisions, one micro-batch)
    # The scoring pass's encodes: the 4 decisions' observations, then the next observations no decision read (one camera).
    assert embedded and embedded[0] == batch.num_decisions and sum(embedded) <= 2 * batch.num_decisions
    # The step's two graphs, and the tower's one per batch size (a second size compiles once more).
    assert counters["stats"]["unique_graphs"] - graphs == 2 + len(set(embedded)) and counters["graph_break"].total() == breaks
    assert metrics_compiled["ppo/first_minibatch_ratio_dev"] <= 1e-6 and metrics_compiled["logprob/behaviour_gap_max"] < 1e-5
    assert metrics_compiled["ppo/optimizer_steps"] == metrics["ppo/optimizer_steps"] > 0
    trained = [name for name, p in eager.policy.named_parameters() if p.requires_grad]
    start, after, after_compiled = (dict(policy.named_parameters()) for policy in
                                    (FlowPolicy.from_pretrained(smolvla_bc), eager.policy, compiled.policy))  # fmt: skip
    assert any(not torch.equal(after[name], start[name]) for name in trained)
    for name in trained:
        torch.testing.assert_close(after_compiled[name], after[name], rtol=1e-4, atol=1e-5)


def test_fused_attention_in_the_actor_and_the_learner_samples_and_trains_as_lerobots_attention_does(smolvla_bc, tmp_path) -> None:
    check_fused_attention_in_actor_and_learner(smolvla_bc, lambda field: tiny_run_config(tmp_path / "run", f"{field}=true"))


def test_an_actor_sending_its_vision_tokens_gives_the_learner_the_update_its_frames_give(smolvla_bc, tmp_path) -> None:
    frames, sending = tiny_run_config(tmp_path / "run"), tiny_run_config(tmp_path / "run", "actors.speed.send_image_embeddings=true")
    check_sent_image_embeddings_in_actor_and_learner(smolvla_bc, frames, sending, lambda policy: policy.vla.model.vlm_with_expert)
    # A bfloat16 actor's tokens travel as float32 without loss: the learner scores the very tokens the actor sampled on.
    bfloat16 = tiny_run_config(tmp_path / "run", "actors.speed.send_image_embeddings=true", "actors.speed.precision=bfloat16")
    batch = RolloutActor(bfloat16, 0, smolvla_bc).sample(None, 0)
    tokens = torch.from_numpy(batch.obs.image_embeddings)
    assert batch.actor_precision.startswith("bfloat16") and tokens.std() > 0 and torch.equal(tokens, tokens.bfloat16().float())
    with pytest.raises(ConfigError, match=r"actors\.speed\.send_image_embeddings with policy\.smolvla\.train_vlm: true"):
        tiny_run_config(tmp_path / "run", "actors.speed.send_image_embeddings=true", "policy.smolvla.train_vlm=true")


def test_bfloat16_actor_stores_the_backbone_in_bfloat16_and_takes_float32_weights(smolvla_bc, tmp_path) -> None:
    config = tiny_run_config(tmp_path / "run", "actors.speed.precision=bfloat16")
    actor = RolloutActor(config, 0, smolvla_bc)
    backbone = actor.policy.vla.model.vlm_with_expert
    assert {p.dtype for p in backbone.parameters()} == {torch.bfloat16}
    assert {p.dtype for n, p in actor.policy.named_parameters() if not n.startswith("vla.model.vlm_with_expert.")} == {torch.float32}

    learner = Learner(config, FlowPolicy.from_pretrained(smolvla_bc))
    with torch.no_grad():  # new trainable weights, so the broadcast below visibly lands
        for p in learner.trainable_state().values():
            p.add_(0.01 * torch.randn_like(p))
    # A float32 broadcast of the trainable tensors lands in the actor's own dtypes: the projections stay float32.
    actor.load_weights(learner.broadcast())
    assert actor.version == learner.version and actor.policy.vla.model.action_out_proj.weight.dtype == torch.float32
    assert torch.equal(actor.policy.vla.model.action_out_proj.weight, learner.policy.vla.model.action_out_proj.weight)
    batch = actor.sample(None, 0)
    assert batch.actor_precision == "bfloat16 autocast over bfloat16+float32 weights on cpu" and batch.chains.dtype == np.float32
    with pytest.warns(BehaviourGapWarning, match=r"actors bfloat16 autocast over bfloat16\+float32 weights on cpu, learner float32 on cpu"):
        data = learner.prepare(batch)
    assert 1e-5 < data.metrics["logprob/behaviour_gap_max"] < 0.1  # a real precision gap, not a weights mismatch


def test_a_rollout_one_version_behind_is_scored_with_its_own_weights_on_smolvla(smolvla_bc, tmp_path) -> None:
    """actors.policy_lag=1 on the SmolVLA backend: after an update moved the learner to v1, it scores a v0 rollout
    (frames, instruction, chains) with the v0 trainable tensors it kept, equal to the actor's own scores, and the
    ratio check passes against v1."""
    config = tiny_run_config(tmp_path / "run", "actors.policy_lag=1")
    actor, learner = RolloutActor(config, 0, smolvla_bc), Learner(config, FlowPolicy.from_pretrained(smolvla_bc))
    v0 = learner.broadcast()
    first, ahead = actor.sample(v0, 0), actor.sample(v0, 1)  # iteration 1 sampled while iteration 0 trains
    learner.update(first)
    learner.broadcast()
    metrics = learner.update(ahead)
    assert ahead.weight_version == 0 and learner.version == 2
    assert metrics["logprob/behaviour_gap_max"] < 1e-4 and metrics["ppo/first_minibatch_ratio_dev"] <= 1e-5
    # v1 scores these chains otherwise (which side of 1 each of the few weights falls on is up to the draw)
    assert max(abs(metrics["ppo/behaviour_weight_min"] - 1), abs(metrics["ppo/behaviour_weight_max"] - 1)) > 1e-5


def test_the_learner_encodes_and_scores_one_micro_batch_at_a_time(smolvla_bc, tmp_path) -> None:
    """prepare() encodes at most minibatch_size / grad_accum rows at a time, observations and the next observations no
    decision read alike, so a VLM's activations do not grow with the iteration (smolvla_base's shapes on an H100: 32 GiB peak for 512
    decisions at once, 17 GiB by 16; bench/smolvla_gpu.py), and scores the chains as many at a time (each denoising
    step copies the prefix cache of the rows it scores); its scores equal one whole-batch pass's."""
    config = tiny_run_config(tmp_path / "run", "algorithm.minibatch_size=4", "algorithm.grad_accum=2")
    batch = RolloutActor(config, 0, smolvla_bc).sample(None, 0)
    learner = Learner(config, FlowPolicy.from_pretrained(smolvla_bc))
    policy, rows, denoised = learner.policy, [], []
    encode, denoise = policy.encode, policy.denoise
    policy.encode = lambda obs: rows.append(obs.batch_shape[0]) or encode(obs)
    policy.denoise = lambda features, action, t: denoised.append(action.shape[0]) or denoise(features, action, t)
    data = learner.prepare(batch)
    del policy.encode, policy.denoise
    assert not (batch.terminated | batch.truncated)[:-1].any()
    assert rows == [2, 2, 1]  # 4 decisions' observations 2 at a time, then the next observation of the last one
    assert denoised == [2] * (2 * policy.num_steps)  # the old log-probs: K steps for each of 2 micro-batches
    with torch.no_grad():
        whole = chain_log_prob(policy, policy.encode(batch.obs.flatten_leading().to_torch(policy.obs_device)), data.chains)
    torch.testing.assert_close(data.old_log_probs, whole.log_prob, rtol=0, atol=1e-5)


LANGUAGE_TASKS = ("reach-v3", "push-v3", "pick-place-v3")


def test_one_smolvla_policy_on_three_tasks_reads_each_envs_instruction(tmp_path) -> None:
    """Three Metaworld tasks, one tiny SmolVLA: BC learns from each task's demonstrations under its own instruction,
    every env's record carries its task's instruction, and the same frames and state under two instructions give
    different chunks (language reaches the action expert), while the same instruction twice gives the same chunk."""
    tasks = ",".join(LANGUAGE_TASKS)
    config = tiny_run_config(tmp_path / "run", f"env.task={tasks}", "policy.obs_dim=42", "policy.smolvla.max_state_dim=42",
                             "actors.num_actors=1", "actors.envs_per_actor=3", "pretrain.train_steps=30")  # fmt: skip
    checkpoint = tmp_path / "bc"
    report = pretrain(config, checkpoint, progress=False)
    assert report["demos"] == 3 and report["instruction"] == {task: TASKS[task].instruction for task in LANGUAGE_TASKS}

    actor = RolloutActor(config, 0, checkpoint)
    batch = actor.sample(None, 0)
    tokenizer = actor.policy.vla.model.vlm_with_expert.processor.tokenizer
    for env, task in enumerate(LANGUAGE_TASKS):
        assert tokenizer.decode(batch.obs.tokens[0, env][batch.obs.token_mask[0, env]]) == TASKS[task].instruction + "\n"
        np.testing.assert_array_equal(batch.obs.state[0, env, 39:], np.eye(3, dtype=np.float32)[env])  # the task's one-hot

    policy = actor.policy
    state, frames = np.repeat(batch.obs.state[0, :1], 3, axis=0), np.repeat(batch.obs.images[0, :1], 3, axis=0)
    tokens, mask = policy.tokenize([TASKS["reach-v3"].instruction, TASKS["push-v3"].instruction, TASKS["reach-v3"].instruction])
    chunks = decide(policy, Observation(state, frames, tokens, mask), deterministic=True).env_actions
    np.testing.assert_array_equal(chunks[0], chunks[2])
    assert np.abs(chunks[0] - chunks[1]).max() > 1e-4
