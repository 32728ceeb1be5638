"""The pi0 and pi0.5 backends on tiny models built offline (CPU, no network; lerobot 0.6 only): parity of the project's
chain with lerobot's own sampler, pi0.5's state prompt, the prefix cache kept intact, the ratio check, what trains,
strict loading of the project's and lerobot's checkpoints, the eval-mode guard, a bfloat16 actor."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
from collections.abc import Callable

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from common.config import ConfigError
from common.policy.lerobot_compat import LEROBOT_LINE, SUPPORTED_LEROBOT

if LEROBOT_LINE < (0, 6):
    pytest.skip(
        f"pi0 / pi0.5 need lerobot 0.6 (its pi0 on lerobot 0.4 needs a patched transformers): {SUPPORTED_LEROBOT[(0, 6)]}",
        allow_module_level=True,
    )

from lerobot.policies.common.vla_utils import prepare_attention_masks_4d  # noqa: E402
from transformers.models.gemma import modeling_gemma  # noqa: E402

from bench.smolvla_gpu import write_lerobot_stand_in  # noqa: E402
from common.policy import OBS_CLIP, CheckpointError, build_policy  # noqa: E402
from common.policy.pi0.model import PiFlowPolicy, gemma_attention, resolve_tokenizer_path  # noqa: E402
from common.policy.pi0.stand_ins import tiny_gemma_sizes  # noqa: E402
from tests.helpers import vla_checks  # noqa: E402
from tests.helpers.vla import INSTRUCTIONS, PI_TYPES, HostReads, pi_config, tiny_observations, tiny_pi  # noqa: E402


@pytest.fixture(scope="module", params=PI_TYPES)
def policy(request) -> PiFlowPolicy:
    return tiny_pi(request.param)


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"policy\.pi0\.paligemma_variant and policy\.pi0\.action_expert_variant must both be tiny"):
        pi_config(pi0={"action_expert_variant": "gemma_300m"}).validate()
    with pytest.raises(ConfigError, match=r"policy\.pi0\.paligemma_variant must be one of"):
        pi_config(pi0={"paligemma_variant": "gemma_7b"}).validate()
    with pytest.raises(ConfigError, match=r"policy\.pi0\.max_state_dim"):
        pi_config(pi0={"max_state_dim": 32}).validate()
    pi_config("pi05", pi0={"max_state_dim": 32}).validate()  # pi0.5 writes the state into its prompt: no width to fit
    with pytest.raises(ConfigError, match=r"policy\.image_size must be > 0 for policy\.type pi05"):
        pi_config("pi05", image_size=0).validate()


def test_registered_backends_are_lerobots_classes_at_tiny_size(policy) -> None:
    assert type(policy.vla).__name__ == {"pi0": "PI0Policy", "pi05": "PI05Policy"}[policy.config.type]
    assert sum(p.numel() for p in policy.parameters()) < 200_000
    assert policy.vla.model.paligemma_with_expert.paligemma.config.text_config.hidden_size == 64
    assert policy.vla.model.action_in_proj.out_features == 32 and policy.noise_head[0].in_features == 32
    # lerobot's builder is restored once the tiny model is built: its real sizes are back
    from lerobot.policies.pi0 import modeling_pi0

    with tiny_gemma_sizes(modeling_pi0, 100):
        assert modeling_pi0.get_gemma_config("tiny").width == 64
    assert modeling_pi0.get_gemma_config("gemma_300m").width == 1024
    with pytest.raises(ValueError, match="Unknown variant"):
        modeling_pi0.get_gemma_config("tiny")


def test_pi0_prompt_is_the_instruction_with_a_newline_after_bos() -> None:
    policy = tiny_pi("pi0")
    ids, mask = policy.tokenize(["push", "pick up the puck"])
    assert ids.shape == mask.shape == (2, 48) and ids.dtype.name == "int64" and mask.dtype == bool
    assert mask.sum(1).tolist() == [1 + len("push\n"), 1 + len("pick up the puck\n")]
    assert policy.tokenizer.decode(ids[0][mask[0]]) == "<bos>push\n"


def test_pi05_prompt_spells_out_the_discretised_state() -> None:
    """lerobot's pi0.5 prompt: "Task: <instruction>, State: <256-bin indices>;\\nAction: ", tokenized at every encode
    from the instruction's tokens and the state normalised into [-1, 1] (clipped std units / OBS_CLIP)."""
    policy = tiny_pi("pi05")
    obs = tiny_observations(policy, 2, seed=3)
    ids, mask = policy.pi05_prompt(obs)
    scaled = (policy.normalized_state(obs) / OBS_CLIP).numpy()
    bins = np.minimum(np.floor((scaled + 1.0) * 128).astype(int), 255)  # bin i covers [-1 + i/128, -1 + (i+1)/128)
    assert 0 <= bins.min() and bins.max() <= 255 and len(set(bins[0].tolist())) > 5
    for row in range(2):
        expected = f"<bos>Task: {INSTRUCTIONS[row]}, State: {' '.join(map(str, bins[row]))};\nAction: "
        assert policy.tokenizer.decode(ids[row][mask[row]]) == expected
    short = tiny_pi("pi05", pi0={"tokenizer_max_length": 100})
    with pytest.raises(ValueError, match=r"policy\.pi0\.tokenizer_max_length=100"):
        short.encode(tiny_observations(short, 1))


def test_a_graph_reads_the_prompt_written_before_it_and_decides_as_the_eager_path(policy, monkeypatch) -> None:
    """A CUDA graph cannot tokenize pi0.5's state prompt, so graph_observation writes it on the host before each replay
    and the capture context reads it from the observation (the replay itself needs a GPU: bench/smolvla_gpu.py). On
    CPU: inside the context no prompt is built and nothing is read back to the host, and the decision equals the eager
    one on the same noise, bit for bit. pi0's observation passes through unchanged."""
    from common.rollout import decision_tensors

    obs = tiny_observations(policy, 2)
    numpy_obs = type(obs)(**{name: value.numpy() for name, value in obs.present().items()})
    graph_obs = policy.graph_observation(numpy_obs)
    if not policy.is_pi05:
        assert graph_obs is numpy_obs
    noise = torch.randn(policy.num_steps + 1, 2, policy.chunk_size, policy.action_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager = decision_tensors(policy, obs, deterministic=False, noise=noise)
        monkeypatch.setattr(policy, "pi05_prompt", lambda _: pytest.fail("a prompt built while capturing"))
        with policy.capture_context(), HostReads() as capturable:
            captured = decision_tensors(policy, graph_obs.to_torch("cpu"), deterministic=False, noise=noise)
    assert capturable.seen == [] and not policy.prompt_written
    for name, value in eager.items():
        assert torch.equal(value, captured[name]), name


def test_chain_sampling_reads_frames_instruction_and_state(policy) -> None:
    obs = tiny_observations(policy, 4)
    vla_checks.check_sampling_reads_frames_instruction_and_state(policy, obs)
    with torch.no_grad():
        assert (policy.encode(obs).suffix_state is None) == (policy.config.type == "pi05")  # pi0's state feeds the expert


@pytest.mark.parametrize("policy_type", ["pi0", "pi05"])
def test_every_camera_goes_through_siglip_in_one_batch_gives_lerobots_prefix_and_may_be_recorded(policy_type) -> None:
    policy = tiny_pi(policy_type, cameras=["corner", "topview", "gripperPOV"])
    obs = tiny_observations(policy, 3, seed=4)
    vla_checks.check_cameras_share_one_vision_pass(policy, obs, policy.vla.model.paligemma_with_expert)
    vla_checks.check_recorded_image_tokens_encode_as_the_frames(policy, obs, policy.vla.model.paligemma_with_expert)


@pytest.mark.parametrize("start", ["zero", "gaussian"])
def test_noise_off_chain_reproduces_lerobot_sample_actions(policy, start) -> None:
    """The project's Euler chain with the noise off == lerobot's own sample_actions (its prefix pass, its Euler loop
    from t=1), same weights, same x_0, float32: within 1e-5."""
    obs = tiny_observations(policy, 3, seed=2)
    assert policy.vla.model.config.num_inference_steps == policy.num_steps
    sample_actions = functools.partial(policy.vla.model.sample_actions, *policy.lerobot_inputs(obs))
    vla_checks.check_noise_off_chain_reproduces_lerobot(policy, obs, start, sample_actions)


def test_denoising_leaves_the_kept_prefix_cache_untouched(policy) -> None:
    vla_checks.check_prefix_cache_kept(policy, tiny_observations(policy, 3, seed=15))


def test_learner_log_probs_equal_actor_log_probs(policy, tmp_path) -> None:
    vla_checks.check_learner_log_probs_equal_actor_log_probs(policy, tiny_observations(policy, 6, seed=4), tmp_path / "ckpt")


def test_a_bf16_backbone_actor_scores_close_to_the_fp32_learner(policy, tmp_path) -> None:
    """lerobot's bfloat16 mode for PaliGemma and the expert (SigLIP, norms and projections float32) samples; the float32
    learner's log-probs differ by a small, nonzero gap."""
    policy.save_pretrained(tmp_path / "ckpt")
    actor = PiFlowPolicy.from_pretrained(tmp_path / "ckpt").set_backbone_dtype(torch.bfloat16)
    assert actor.vla.model.paligemma_with_expert.gemma_expert.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert actor.vla.model.action_out_proj.weight.dtype == torch.float32
    assert 1e-5 < vla_checks.bf16_actor_gap(policy, actor, tiny_observations(policy, 4, seed=12)) < 0.05


def test_recomputed_denoising_steps_keep_less_for_the_same_gradients(policy) -> None:
    vla_checks.check_recomputed_steps_keep_less_for_the_same_gradients(policy, tiny_observations(policy, 2))


def test_denoising_steps_in_one_pass_give_the_same_gradients_in_fewer_ops(policy) -> None:
    vla_checks.check_steps_in_one_pass_give_the_same_gradients_in_fewer_ops(policy, tiny_observations(policy, 2))


def test_fused_gemma_attention_is_transformers_eager_attention_up_to_rounding_even_where_a_query_sees_no_key(policy) -> None:
    """gemma_attention against transformers' Gemma eager_attention_forward, on the tiny expert's grouped heads and a
    mask lerobot builds (finite where a query may not look)."""
    layer = policy.gemmas()[1].layers[0].self_attn
    heads, kv_heads, head_dim = policy.gemmas()[1].config.num_attention_heads, layer.config.num_key_value_heads, layer.head_dim
    assert heads > kv_heads
    generator = torch.Generator().manual_seed(11)
    query = torch.randn(3, heads, 5, head_dim, generator=generator, requires_grad=True)
    key, value = (torch.randn(3, kv_heads, 7, head_dim, generator=generator, requires_grad=True) for _ in range(2))
    sees = torch.rand(3, 5, 7, generator=generator) > 0.5
    sees[:, :, 0] = True  # every query sees a key
    blind = sees.clone()
    blind[1, 2] = False  # this query sees none
    masks = {False: prepare_attention_masks_4d(sees), True: prepare_attention_masks_4d(blind)}

    def attend(function: Callable[..., tuple[Tensor, object]]) -> Callable[..., Tensor]:
        return lambda query, key, value, sees_none: function(layer, query, key, value, masks[sees_none], layer.scaling)[0]

    vla_checks.check_attention_function_as_eager(
        attend(gemma_attention), attend(modeling_gemma.eager_attention_forward), (query, key, value)
    )


def test_a_policy_with_fused_attention_scores_as_the_eager_one_does_and_keeps_less_for_backward(policy) -> None:
    """PiFlowPolicy.fuse_attention: every denoising step of lerobot's sets the expert's config back to eager attention,
    and lerobot's sampler both Gemmas'; the layers keep the fused one through both."""
    fused = copy.deepcopy(policy)
    obs = tiny_observations(policy, 3, seed=7)
    vla_checks.check_fused_attention_scores_as_eager_and_keeps_less(policy, fused, obs)
    fused.fuse_attention()
    images, image_masks, tokens, token_mask, *state = fused.lerobot_inputs(obs)
    with torch.no_grad():
        fused.vla.model.sample_actions(images, image_masks, tokens, token_mask, *state)
    assert fused.attention_fused and all(gemma.config._attn_implementation == "eager" for gemma in fused.gemmas())


@pytest.mark.parametrize("policy_type", PI_TYPES)
def test_compiled_denoising_steps_follow_the_eager_ones(policy_type) -> None:
    policy = tiny_pi(policy_type)
    vla_checks.check_compiled_steps_follow_the_eager_ones(policy, tiny_observations(policy, 3))


@pytest.mark.parametrize("policy_type", PI_TYPES)
def test_compiled_scoring_gives_the_same_gradients_in_fewer_ops(policy_type) -> None:
    policy = tiny_pi(policy_type)
    vla_checks.check_compiled_scoring_gives_the_same_gradients_in_fewer_ops(policy, tiny_observations(policy, 2))


@pytest.mark.parametrize("policy_type", PI_TYPES)
def test_a_compiled_vision_tower_follows_the_eager_one(policy_type) -> None:
    policy = tiny_pi(policy_type, cameras=["corner", "topview", "gripperPOV"])
    vla_checks.check_compiled_vision_follows_the_eager_one(policy, tiny_observations(policy, 3, seed=6))


@pytest.mark.parametrize("policy_type", PI_TYPES)
def test_train_keeps_the_lerobot_model_in_eval_mode(policy_type) -> None:
    policy = tiny_pi(policy_type, pi0={"train_vlm": True})
    vla_checks.check_train_keeps_the_lerobot_model_in_eval_mode(policy, tiny_observations(policy, 2))


@pytest.mark.parametrize(
    ("policy_type", "flags"),
    [
        ("pi0", {}),  # the defaults: action projections, time MLP, state projection, noise head, critic
        ("pi05", {}),  # the defaults: action projections, time MLP and the expert's adaRMS layers, noise head, critic
        ("pi0", {"train_action_proj": False, "train_state_proj": False, "train_expert": True}),
        ("pi05", {"train_time_mlp": False, "train_expert": True}),
    ],
)
def test_a_ppo_step_changes_exactly_the_selected_tensors(policy_type, flags) -> None:
    policy = tiny_pi(policy_type, pi0=flags)
    trainable = {name for name, p in policy.named_parameters() if p.requires_grad}
    if policy_type == "pi05" and policy.config.pi0.train_time_mlp:
        assert any(".input_layernorm.dense." in name for name in trainable)  # the adaRMS time conditioning trains
    changed, trainable = vla_checks.ppo_step_changes(policy, tiny_observations(policy, 8, seed=6))
    unused = "vla.model.paligemma_with_expert.gemma_expert.lm_head.weight"  # lerobot's expert never decodes tokens
    assert policy.get_parameter(unused).grad is None
    assert changed == trainable - {unused}
    vlm_names = [n for n, _ in policy.named_parameters() if n.startswith("vla.model.paligemma_with_expert.paligemma.")]
    assert vlm_names and not changed.intersection(vlm_names)  # PaliGemma is bit-identical


def test_round_trip_and_strict_load_refusing_a_missing_tensor(policy, tmp_path) -> None:
    dropped = "vla.model.paligemma_with_expert.gemma_expert.model.layers.1.self_attn.k_proj.weight"
    vla_checks.check_round_trip_and_strict_refusal(
        policy, tmp_path / "ckpt", dropped, tokenizer_path=str(resolve_tokenizer_path(policy.config))
    )


def test_lerobot_checkpoint_round_trip_and_strict_refusal(policy, tmp_path) -> None:
    """A checkpoint as lerobot's save_pretrained writes it loads into a fresh policy tensor for tensor; one lacking a
    tensor is refused with that tensor named (lerobot's own loader would keep it random), and so is another size."""
    lerobot_dir = tmp_path / "lerobot"
    policy.vla.save_pretrained(lerobot_dir)
    assert json.loads((lerobot_dir / "config.json").read_text())["type"] == policy.config.type
    torch.manual_seed(1)
    fresh = build_policy(pi_config(policy.config.type, pi0={"lerobot_checkpoint": str(lerobot_dir)}))
    for name, tensor in policy.vla.state_dict().items():
        assert torch.equal(tensor, fresh.vla.state_dict()[name]), name
    fresh.save_pretrained(tmp_path / "ours")  # the saved policy holds every tensor and never reads the lerobot one again
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["pi0"]["lerobot_checkpoint"] == ""

    with pytest.raises(CheckpointError, match="max_action_dim=4"):
        tiny_pi(policy.config.type, pi0={"lerobot_checkpoint": str(lerobot_dir), "max_action_dim": 8})
    other = "pi05" if policy.config.type == "pi0" else "pi0"
    with pytest.raises(CheckpointError, match=f"lerobot '{policy.config.type}' checkpoint, not {other}"):
        tiny_pi(other, pi0={"lerobot_checkpoint": str(lerobot_dir)})
    weights = load_file(str(lerobot_dir / "model.safetensors"))
    dropped = "model.action_out_proj.bias"
    del weights[dropped]
    save_file(weights, str(lerobot_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"lacks 1 of .*model\.action_out_proj\.bias"):
        tiny_pi(policy.config.type, pi0={"lerobot_checkpoint": str(lerobot_dir)})


def test_a_32_wide_pi0_state_projection_loads_only_with_reinit_state_proj(tmp_path) -> None:
    """pi0_base's state_proj is 32 wide, Metaworld's state 39: refused (naming max_state_dim and the option); with
    policy.pi0.reinit_state_proj only state_proj keeps its fresh 39-wide initialisation."""
    torch.manual_seed(2)
    base = build_policy(pi_config(obs_dim=32, pi0={"max_state_dim": 32}))
    lerobot_dir = tmp_path / "pi0_base_like"
    base.vla.save_pretrained(lerobot_dir)
    file_state = load_file(str(lerobot_dir / "model.safetensors"))
    pi0 = {"lerobot_checkpoint": str(lerobot_dir)}
    with pytest.raises(CheckpointError, match=r"max_state_dim=32 \(config has 39\).*reinit_state_proj: true"):
        tiny_pi(pi0=pi0)
    torch.manual_seed(3)
    widened = build_policy(pi_config(pi0={**pi0, "reinit_state_proj": True}))
    assert vla_checks.check_reinit_state_proj(widened, file_state) and widened.vla.model.state_proj.weight.shape[1] == 39


def test_a_lerobot_stand_in_is_written_by_lerobot_and_loads_strictly(tmp_path) -> None:
    """write_lerobot_stand_in (the GPU benchmark's hook) writes a checkpoint with lerobot's own save_pretrained, of
    the model the config describes; the config naming it as lerobot_checkpoint loads every tensor of it."""
    config = pi_config("pi05")
    directory = write_lerobot_stand_in(tmp_path / "stand_in", config)
    saved = json.loads((directory / "config.json").read_text())
    assert saved["type"] == "pi05" and saved["paligemma_variant"] == "tiny" and (directory / "model.safetensors").is_file()
    loaded = build_policy(dataclasses.replace(config, pi0=dataclasses.replace(config.pi0, lerobot_checkpoint=str(directory))))
    file_state = load_file(str(directory / "model.safetensors"))
    assert set(file_state) == set(loaded.vla.state_dict())
    assert all(torch.equal(tensor, file_state[name]) for name, tensor in loaded.vla.state_dict().items())
