"""The SmolVLA backend on a tiny SmolVLA built offline (CPU, no network), on whichever supported lerobot is
installed (0.4.x on Python 3.11, 0.6.x on Python >= 3.12): chain sampling through lerobot's model, parity with
that lerobot's own sampler, the prefix cache kept intact, the ratio check, what trains, strict loading, eval-mode
guard, and the ratio sensitivity of summed log-probs on SmolVLA's 50-action chunk.

`python -m tests.integration.test_smolvla` prints the clip fractions of summed and averaged log-probs quoted in docs/smolvla.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from common.config import ConfigError, EnvConfig, PolicyConfig, RunConfig
from common.config_loading import load_config
from common.diagnostics import RatioSensitivityWarning, check_ratio_sensitivity
from common.flow import chain_log_prob, num_log_prob_elements, sample_chain
from common.lerobot_checkpoint import check_features
from common.policy import CheckpointError, FlowPolicy, build_policy, index_features, write_directory_atomically
from common.policy.lerobot_compat import LEROBOT_LINE, denoise_cache, dynamic_cache, kv_layers, lerobot_line, resize_with_pad
from common.policy.smolvla.model import SmolVLAFlowPolicy, SmolVLAPolicy, fused_attention
from common.policy.smolvla.stand_ins import TinyVLMSpec, tiny_vlm_dir
from common.policy.torchvision_shim import META_MODULE
from common.policy.vla_common import lerobot_flow_time, one_vision_pass
from common.rl import normalize, ppo_policy_loss
from common.suites import make_suite
from tests.conftest import REPO
from tests.helpers.vla import IMAGE_SIZE, smolvla_config, tiny_observations, tiny_smolvla
from tests.helpers.vla_checks import (
    bf16_actor_gap,
    check_attention_function_as_eager,
    check_cameras_share_one_vision_pass,
    check_compiled_steps_follow_the_eager_ones,
    check_compiled_vision_follows_the_eager_one,
    check_fused_attention_scores_as_eager_and_keeps_less,
    check_learner_log_probs_equal_actor_log_probs,
    check_noise_off_chain_reproduces_lerobot,
    check_prefix_cache_kept,
    check_recomputed_steps_keep_less_for_the_same_gradients,
    check_recorded_image_tokens_encode_as_the_frames,
    check_reinit_state_proj,
    check_round_trip_and_strict_refusal,
    check_sampling_reads_frames_instruction_and_state,
    check_steps_in_one_pass_give_the_same_gradients_in_fewer_ops,
    check_train_keeps_the_lerobot_model_in_eval_mode,
    ppo_step_changes,
)


@pytest.fixture(scope="module")
def policy() -> SmolVLAFlowPolicy:
    return tiny_smolvla()


def test_registered_backend_and_tiny_backbone_is_small(policy) -> None:
    assert isinstance(policy, SmolVLAFlowPolicy)
    assert sum(p.numel() for p in policy.parameters()) < 500_000
    with pytest.raises(CheckpointError, match="num_vlm_layers <= 2"):
        build_policy(smolvla_config(smolvla={"num_vlm_layers": 3}))


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"policy\.image_size must be > 0"):
        smolvla_config(image_size=0).validate()
    with pytest.raises(ConfigError, match=r"policy\.smolvla\.max_state_dim"):
        smolvla_config(smolvla={"max_state_dim": 32}).validate()
    with pytest.raises(ConfigError, match=r"policy\.smolvla\.vlm_path is empty"):
        smolvla_config(smolvla={"lerobot_checkpoint": "/somewhere"}).validate()


def test_tokenize_pads_to_a_fixed_length_with_a_trailing_newline(policy) -> None:
    ids, mask = policy.tokenize(["push", "pick up the puck"])
    assert ids.shape == mask.shape == (2, 48) and ids.dtype.name == "int64" and mask.dtype == bool
    assert mask.sum(1).tolist() == [len("push\n"), len("pick up the puck\n")]
    tokenizer = policy.vla.model.vlm_with_expert.processor.tokenizer
    assert tokenizer.decode(ids[0][mask[0]]) == "push\n"


def test_chain_sampling_reads_frames_instruction_and_state(policy) -> None:
    obs = tiny_observations(policy, 4)
    check_sampling_reads_frames_instruction_and_state(policy, obs)
    with torch.no_grad():
        assert index_features(policy.encode(obs), torch.tensor([2])).key_states[0].shape[0] == 1


@pytest.fixture(scope="module")
def three_cameras() -> SmolVLAFlowPolicy:
    return tiny_smolvla(cameras=["corner", "topview", "gripperPOV"])


def test_every_camera_goes_through_siglip_in_one_batch_gives_lerobots_prefix_and_may_be_recorded(three_cameras) -> None:
    policy = three_cameras
    check_cameras_share_one_vision_pass(policy, tiny_observations(policy, 3, seed=4), policy.vla.model.vlm_with_expert)
    check_recorded_image_tokens_encode_as_the_frames(policy, tiny_observations(policy, 3, seed=4), policy.vla.model.vlm_with_expert)
    vlm_with_expert = policy.vla.model.vlm_with_expert
    images = list(torch.rand(4, 3, IMAGE_SIZE, IMAGE_SIZE).split(2))
    embedded = vlm_with_expert.embed_image(torch.cat(images))
    with pytest.raises(RuntimeError, match="other than the next camera's"), one_vision_pass(vlm_with_expert, images, embedded):
        vlm_with_expert.embed_image(images[1])
    with pytest.raises(RuntimeError, match="never asked for"), one_vision_pass(vlm_with_expert, images, embedded):
        vlm_with_expert.embed_image(images[0])
    assert "embed_image" not in vars(vlm_with_expert)  # lerobot's method is back


def test_frames_of_all_cameras_are_preprocessed_at_once_as_lerobot_does_each(three_cameras) -> None:
    """All cameras' frames resized with padding and mapped to [-1, 1] in one pass, against the same per camera."""
    obs = tiny_observations(three_cameras, 3, seed=5)
    small = torch.randint(0, 256, (3, 3, 24, 20, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    images, *_ = three_cameras.lerobot_inputs(dataclasses.replace(obs, images=small))
    assert len(images) == 3
    for camera, image in enumerate(images):
        frames = small[:, camera].permute(0, 3, 1, 2).float() / 255.0
        assert torch.equal(image, resize_with_pad(frames, IMAGE_SIZE, IMAGE_SIZE, pad_value=0) * 2.0 - 1.0)


def test_time_convention_map() -> None:
    t = torch.tensor([0.0, 0.25, 0.5])
    lerobot_t, sign = lerobot_flow_time(t)
    assert torch.equal(lerobot_t, torch.tensor([1.0, 0.75, 0.5])) and sign == -1.0


@pytest.mark.parametrize("start", ["zero", "gaussian"])
def test_noise_off_chain_reproduces_lerobot_sample_actions(policy, start) -> None:
    """The project's Euler chain with the noise off == the installed lerobot's own sampler, same weights, same x_0."""
    obs = tiny_observations(policy, 3, seed=2)
    assert policy.vla.model.config.num_steps == policy.num_steps
    check_noise_off_chain_reproduces_lerobot(
        policy, obs, start, functools.partial(policy.vla.model.sample_actions, *policy.lerobot_inputs(obs))
    )


def test_denoising_leaves_the_kept_prefix_cache_untouched(policy) -> None:
    obs = tiny_observations(policy, 3, seed=15)
    check_prefix_cache_kept(policy, obs)
    with torch.no_grad():
        features = policy.encode(obs)
    model = policy.vla.model.vlm_with_expert
    assert denoise_cache(model, features.kv()) is not denoise_cache(model, features.kv())
    # The DynamicCache form (0.6's SmolVLA; pi0 on both lines) holds the same tensors in its own layout.
    round_trip = kv_layers(dynamic_cache(features.kv()))
    assert all(torch.equal(a, b) for a, b in zip(round_trip[0] + round_trip[1], features.key_states + features.value_states))


@pytest.mark.parametrize(("height", "width"), [(16, 8), (8, 16)])
def test_resize_with_pad_takes_height_then_width_on_either_lerobot_line(height, width) -> None:
    """lerobot 0.4 takes (width, height), 0.6 (height, width); the adapter takes (height, width) on both. The image
    keeps its aspect and sits bottom-right, padded on the left and top."""
    image = torch.rand(2, 3, 4, 4, generator=torch.Generator().manual_seed(18))
    side = min(height, width)
    expected = torch.full((2, 3, height, width), -1.0)
    expected[..., height - side :, width - side :] = F.interpolate(image, size=(side, side), mode="bilinear", align_corners=False)
    torch.testing.assert_close(resize_with_pad(image, height, width, pad_value=-1.0), expected)


def test_the_lerobot_line_is_checked_and_the_torchvision_shim_only_acts_beside_a_cpu_torch() -> None:
    import sys

    import torchvision

    assert lerobot_line("0.4.4") == (0, 4) and lerobot_line("0.6.1") == (0, 6) and LEROBOT_LINE in {(0, 4), (0, 6)}
    with pytest.raises(ImportError, match=r"lerobot 0\.5\.0 is installed.*0\.4\.x on Python 3\.11.*0\.6\.x on Python >= 3\.12"):
        lerobot_line("0.5.0")
    # The empty stand-in for torchvision's meta registrations (a module without a file) is there exactly when a
    # CPU torch meets a CUDA torchvision; a matching pair imports torchvision's own.
    stand_in = not hasattr(sys.modules[META_MODULE], "__file__")
    assert stand_in == (torch.version.cuda is None and "+cu" in torchvision.__version__)


def test_learner_log_probs_equal_actor_log_probs(policy, tmp_path) -> None:
    check_learner_log_probs_equal_actor_log_probs(policy, tiny_observations(policy, 6, seed=4), tmp_path / "ckpt")


def test_a_bf16_backbone_actor_scores_close_to_the_fp32_learner(policy, tmp_path) -> None:
    """Mixed precision: a bf16 VLM + expert (fp32 heads) samples; the fp32 learner's log-probs then differ
    by a small, nonzero gap (the metric the learner logs), not by the ratio check's 1e-5."""
    policy.save_pretrained(tmp_path / "ckpt")
    actor = SmolVLAFlowPolicy.from_pretrained(tmp_path / "ckpt").set_backbone_dtype(torch.bfloat16)
    assert actor.precision == "bfloat16+float32 on cpu"
    assert 1e-5 < bf16_actor_gap(policy, actor, tiny_observations(policy, 4, seed=12)) < 0.05


class WeightCasts(TorchDispatchMode):
    """Counts the elements of the given parameters that are cast (aten._to_copy) while it is active."""

    def __init__(self, parameters: list[nn.Parameter]):
        super().__init__()
        self.pointers, self.elements = {p.data_ptr() for p in parameters}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.pointers:
            self.elements += args[0].numel()
        return func(*args, **(kwargs or {}))


def test_autocast_alone_recasts_the_frozen_backbone_at_every_call() -> None:
    """Why bfloat16 actors also call set_backbone_dtype: autocast's cast cache keeps only weights that
    require grad, so over float32 weights one chunk decision casts the frozen VLM once (encode) and the
    frozen expert once per denoising step; with the backbone stored in bfloat16 nothing of it is cast."""
    policy = tiny_smolvla()
    model = policy.vla.model.vlm_with_expert
    backbone = [p for p in model.parameters() if p.dim() == 2]  # matmul weights: what autocast casts
    vlm_elements = sum(p.numel() for p in model.vlm.parameters() if p.dim() == 2)
    expert_elements = sum(p.numel() for p in model.lm_expert.parameters() if p.dim() == 2)
    obs = tiny_observations(policy, 2)

    def backbone_elements_cast_per_chunk() -> int:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), WeightCasts(backbone) as casts:
            sample_chain(policy, policy.encode(obs), 2, generator=torch.Generator().manual_seed(0))
        return casts.elements

    # At least the text layers of the VLM (the vision tower too) and the expert's layers at each of the K steps.
    assert backbone_elements_cast_per_chunk() >= 0.5 * vlm_elements + policy.num_steps * 0.5 * expert_elements
    assert policy.set_backbone_dtype(torch.bfloat16) is policy
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in policy.noise_head.parameters()} | {p.dtype for p in policy.vla.model.action_out_proj.parameters()} == {
        torch.float32
    }
    assert backbone_elements_cast_per_chunk() == 0


def test_recomputed_denoising_steps_keep_less_for_the_same_gradients() -> None:
    policy = tiny_smolvla()
    check_recomputed_steps_keep_less_for_the_same_gradients(policy, tiny_observations(policy, 2))


def test_denoising_steps_in_one_pass_give_the_same_gradients_in_fewer_ops() -> None:
    policy = tiny_smolvla()
    check_steps_in_one_pass_give_the_same_gradients_in_fewer_ops(policy, tiny_observations(policy, 2))


def test_compiled_denoising_steps_follow_the_eager_ones() -> None:
    policy = tiny_smolvla()
    check_compiled_steps_follow_the_eager_ones(policy, tiny_observations(policy, 3))


def test_fused_attention_is_lerobots_eager_attention_up_to_rounding_even_where_a_query_sees_no_key(policy) -> None:
    """fused_attention against the installed lerobot's eager_attention_forward, on the tiny model's head counts (grouped
    keys and values); where a query sees no key, lerobot averages every value."""
    model = policy.vla.model.vlm_with_expert
    heads, kv_heads, head_dim = model.num_attention_heads, model.num_key_value_heads, 8
    assert heads > kv_heads
    generator = torch.Generator().manual_seed(11)
    query = torch.randn(3, 5, heads, head_dim, generator=generator, requires_grad=True)
    key, value = (torch.randn(3, 7, kv_heads, head_dim, generator=generator, requires_grad=True) for _ in range(2))
    mask = torch.rand(3, 5, 7, generator=generator) > 0.5
    mask[:, :, 0] = True  # every query sees a key
    blind = mask.clone()
    blind[1, 2] = False  # this query sees none

    def attend(function: Callable[..., Tensor]) -> Callable[..., Tensor]:
        return lambda query, key, value, sees_none: function(blind if sees_none else mask, 3, head_dim, query, key, value)

    check_attention_function_as_eager(attend(fused_attention), attend(model.eager_attention_forward), (query, key, value))
    with torch.no_grad():
        eager = model.eager_attention_forward(blind, 3, head_dim, query, key, value)
        torch.testing.assert_close(eager[1, 2], value[1].mean(0).repeat_interleave(heads // kv_heads, 0).flatten())


def test_a_policy_with_fused_attention_scores_as_lerobots_attention_does_and_keeps_less_for_backward() -> None:
    """SmolVLAFlowPolicy.fuse_attention: lerobot asks its model for the attention function at every layer, and gets
    lerobot's own method back once the fused one is switched off."""
    eager, fused = tiny_smolvla(), tiny_smolvla()
    check_fused_attention_scores_as_eager_and_keeps_less(eager, fused, tiny_observations(eager, 3, seed=7))
    interface = fused.vla.model.vlm_with_expert.get_attention_interface()
    assert interface.__func__.__name__ == "eager_attention_forward"


def test_a_compiled_vision_tower_follows_the_eager_one(three_cameras) -> None:
    check_compiled_vision_follows_the_eager_one(three_cameras, tiny_observations(three_cameras, 3, seed=6))


def test_a_compiled_vision_tower_is_refused_in_one_line_where_no_kernel_compiler_is_installed(monkeypatch) -> None:
    import shutil

    policy = tiny_smolvla()
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match=r"^actors\.speed\.compile_vision: .* cpu kernels .*set actors\.speed\.compile_vision: false$"):
        policy.compile_vision("actors.speed.compile_vision")
    assert policy.compiled_vision is None


def test_train_keeps_the_lerobot_model_in_eval_mode() -> None:
    """A reported failure: .train() on a wrapper put SmolVLA's dropout on and log-probs became random."""
    policy = tiny_smolvla(smolvla={"train_vlm": True})
    check_train_keeps_the_lerobot_model_in_eval_mode(policy, tiny_observations(policy, 2))


@pytest.mark.parametrize(
    "flags",
    [
        {},  # the defaults: action projections, time MLP, noise head, critic
        {"train_action_proj": False, "train_time_mlp": False, "train_expert": True},
    ],
)
def test_a_ppo_step_changes_exactly_the_selected_tensors(flags) -> None:
    policy = tiny_smolvla(smolvla=flags)
    changed, trainable = ppo_step_changes(policy, tiny_observations(policy, 8, seed=6))
    assert changed == trainable
    vlm_names = [n for n, _ in policy.named_parameters() if n.startswith("vla.model.vlm_with_expert.vlm.")]
    assert vlm_names and not changed.intersection(vlm_names)  # the VLM is bit-identical


def test_set_trainable_switches_groups_for_a_loaded_policy() -> None:
    policy = tiny_smolvla()
    policy.set_trainable(train_vlm=True, train_critic=False)
    assert policy.config.smolvla.train_vlm and policy.encoder_is_trainable
    assert all(p.requires_grad for p in policy.vla.model.vlm_with_expert.vlm.parameters())
    assert not any(name.startswith("critic_head.") for name in policy.broadcast_state())
    with pytest.raises(ValueError, match="train_vlms"):
        policy.set_trainable(train_vlms=True)


def test_round_trip_and_strict_load_refusing_a_missing_tensor(policy, tmp_path) -> None:
    vlm_path = str(tiny_vlm_dir(TinyVLMSpec(image_size=IMAGE_SIZE)))
    dropped = "vla.model.vlm_with_expert.lm_expert.layers.1.self_attn.k_proj.weight"
    check_round_trip_and_strict_refusal(policy, tmp_path / "ckpt", dropped, vlm_path=vlm_path)


def test_lerobot_checkpoint_loads_strictly_with_the_vlm_path_overridden(policy, tmp_path) -> None:
    """A lerobot-format checkpoint (as lerobot saves it) names its VLM by hub id; vlm_path replaces it
    offline, and a checkpoint lacking one tensor is refused with that tensor named."""
    lerobot_dir = tmp_path / "smolvla_lerobot"
    policy.vla.save_pretrained(lerobot_dir)
    config = json.loads((lerobot_dir / "config.json").read_text())
    config["vlm_model_name"] = "HuggingFaceTB/SmolVLM2-500M-Video-Instruct"  # as in lerobot/smolvla_base
    (lerobot_dir / "config.json").write_text(json.dumps(config))

    vlm_path = str(tiny_vlm_dir(TinyVLMSpec(image_size=IMAGE_SIZE)))
    fresh = tiny_smolvla(seed=1, smolvla={"lerobot_checkpoint": str(lerobot_dir), "vlm_path": vlm_path})
    for name, tensor in policy.vla.state_dict().items():
        assert torch.equal(tensor, fresh.vla.state_dict()[name]), name
    # The checkpoint's hub id for the backbone is kept, through a save and a load, for an export to name it by.
    saved = write_directory_atomically(tmp_path / "saved", fresh.save_pretrained)
    assert SmolVLAFlowPolicy.from_pretrained(saved).lerobot_hub_id() == "HuggingFaceTB/SmolVLM2-500M-Video-Instruct"
    with pytest.raises(ConfigError, match=r"policy.smolvla.vlm_hub_id must be a hub id as owner/name .* got '/models/smolvlm'"):
        smolvla_config(smolvla={"vlm_hub_id": "/models/smolvlm"}).validate()

    weights = load_file(str(lerobot_dir / "model.safetensors"))
    dropped = "model.action_time_mlp_out.bias"
    del weights[dropped]
    save_file(weights, str(lerobot_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"lacks 1 of .*model\.action_time_mlp_out\.bias"):
        tiny_smolvla(smolvla={"lerobot_checkpoint": str(lerobot_dir), "vlm_path": vlm_path})
    # For contrast, lerobot's own loader (its VLM pointed at the local backbone) accepts the same file and
    # leaves the missing tensor at its random initialisation without a word.
    (lerobot_dir / "config.json").write_text(json.dumps({**config, "vlm_model_name": vlm_path}))
    torch.manual_seed(5)  # not the seed `policy` drew its weights from
    silently_random = SmolVLAPolicy.from_pretrained(str(lerobot_dir))
    assert not torch.equal(silently_random.model.action_time_mlp_out.bias, policy.vla.model.action_time_mlp_out.bias)
    with pytest.raises(CheckpointError, match="max_action_dim=4"):
        tiny_smolvla(smolvla={"lerobot_checkpoint": str(lerobot_dir), "vlm_path": vlm_path, "max_action_dim": 8})


def test_a_32_wide_state_projection_loads_into_a_39_d_policy_only_with_reinit_state_proj(tmp_path) -> None:
    """smolvla_base's state_proj is 32 wide, Metaworld's state 39: a strict load is refused (naming
    max_state_dim and the option); with policy.smolvla.reinit_state_proj only state_proj keeps its fresh
    39-wide initialisation, every other tensor still comes from the file, and a missing one is still refused."""
    torch.manual_seed(2)
    base = build_policy(smolvla_config(obs_dim=32, smolvla={"max_state_dim": 32}))  # stands in for smolvla_base
    lerobot_dir = tmp_path / "smolvla_base_like"
    base.vla.save_pretrained(lerobot_dir)
    file_state = load_file(str(lerobot_dir / "model.safetensors"))
    assert file_state["model.state_proj.weight"].shape[1] == 32
    assert json.loads((lerobot_dir / "config.json").read_text())["max_state_dim"] == 32
    vlm_path = str(tiny_vlm_dir(TinyVLMSpec(image_size=IMAGE_SIZE)))
    smolvla = {"lerobot_checkpoint": str(lerobot_dir), "vlm_path": vlm_path}
    with pytest.raises(CheckpointError, match=r"max_state_dim=32 \(config has 39\).*reinit_state_proj: true"):
        tiny_smolvla(smolvla=smolvla)

    torch.manual_seed(3)
    widened = build_policy(smolvla_config(smolvla={**smolvla, "reinit_state_proj": True}))
    assert check_reinit_state_proj(widened, file_state)
    assert widened.vla.model.state_proj.weight.shape[1] == 39
    # All 39 state elements reach the velocity, the 7 beyond smolvla_base's width included.
    obs = tiny_observations(widened, 2, seed=14)
    a_t, t = torch.randn(2, 4, 4), torch.full((2,), 0.5)
    with torch.no_grad():
        base_velocity = widened.velocity(a_t, t, widened.encode(obs))
        state = obs.state.clone()
        state[:, 35] += 1.0
        moved = widened.velocity(a_t, t, widened.encode(dataclasses.replace(obs, state=state)))
    assert (moved - base_velocity).abs().max() > 1e-4
    # The saved policy holds the new projection; reloading it reads no lerobot checkpoint.
    widened.save_pretrained(tmp_path / "ours")
    assert torch.equal(FlowPolicy.from_pretrained(tmp_path / "ours").vla.model.state_proj.weight, widened.vla.model.state_proj.weight)

    del file_state["model.action_in_proj.weight"]
    save_file(file_state, str(lerobot_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"lacks 1 of .*model\.action_in_proj\.weight"):
        build_policy(smolvla_config(smolvla={**smolvla, "reinit_state_proj": True}))


# -- summed log-probs over SmolVLA's 50 x A chunk with sigma in [0.08, 0.16] ------------------

SMOLVLA_CHUNK = dict(chunk_size=50, num_steps=1, sigma_min=0.08, sigma_max=0.16)


SMOLVLA_PPO = load_config(REPO / "configs" / "smolvla_pick.yaml").algorithm


def clip_fraction_after_one_update(normalization: str, batch: int = 16) -> dict[str, float]:
    """One real PPO step (the shipped SmolVLA recipe's actor_lr and clip_eps, Adam) on chains sampled by the
    tiny SmolVLA with a 50-action chunk, then the next minibatch's clip fraction on the same chains."""
    ppo = SMOLVLA_PPO
    policy = tiny_smolvla(log_prob_normalization=normalization, **SMOLVLA_CHUNK)
    obs = tiny_observations(policy, batch, seed=9)
    with torch.no_grad():
        features = policy.encode(obs)
        sample = sample_chain(policy, features, batch, generator=torch.Generator().manual_seed(10))
    advantages = normalize(torch.randn(batch, generator=torch.Generator().manual_seed(11)))
    critic = set(policy.critic_parameter_names())
    optimizer = torch.optim.Adam([p for n, p in policy.named_parameters() if p.requires_grad and n not in critic], lr=ppo.actor_lr)
    policy.train()
    pg_loss, before = ppo_policy_loss(
        chain_log_prob(policy, features, sample.chain).log_prob, sample.scores.log_prob, advantages, ppo.clip_eps
    )
    optimizer.zero_grad()
    pg_loss.backward()
    optimizer.step()
    with torch.no_grad():
        _, after = ppo_policy_loss(
            chain_log_prob(policy, features, sample.chain).log_prob, sample.scores.log_prob, advantages, ppo.clip_eps
        )
    return {
        "elements": num_log_prob_elements(policy.config),
        "clipfrac_before": float(before["clipfrac"]),
        "clipfrac": float(after["clipfrac"]),
        "ratio_min": float(after["ratio_min"]),
        "ratio_max": float(after["ratio_max"]),
    }


def test_summed_log_probs_warn_and_clip_everything() -> None:
    config = smolvla_config(**SMOLVLA_CHUNK)
    elements = config.chunk_size * config.action_dim * config.num_steps
    with pytest.warns(RatioSensitivityWarning, match="log_prob_normalization='mean'"):
        check_ratio_sensitivity(elements, config.sigma_min, "sum", SMOLVLA_PPO.clip_eps)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RatioSensitivityWarning)
        check_ratio_sensitivity(elements, config.sigma_min, "mean", SMOLVLA_PPO.clip_eps)

    summed, averaged = clip_fraction_after_one_update("sum"), clip_fraction_after_one_update("mean")
    print(f"\nsummed log-probs on SmolVLA's chunk: sum {summed}\n                              mean {averaged}")
    assert summed["elements"] == averaged["elements"] == 200
    assert summed["clipfrac_before"] == averaged["clipfrac_before"] == 0.0
    assert summed["clipfrac"] >= 0.9
    assert averaged["clipfrac"] <= 0.25


if __name__ == "__main__":
    for normalization in ("sum", "mean"):
        print(normalization, clip_fraction_after_one_update(normalization))


def test_a_lerobot_checkpoints_input_features_are_checked_against_the_suite_before_any_work(policy, tmp_path) -> None:
    """A checkpoint as lerobot saves it names the frames and the state it reads (input_features): the run's policy must
    be given those frames, from cameras the suite renders, and the state width must be the run's unless state_proj is
    learnt anew; each mismatch is one line naming the field to set. (A frame no layout gives, and the map that gives it:
    tests/integration/test_lerobot_layout.py.)"""
    lerobot_dir = tmp_path / "smolvla_lerobot"
    policy.vla.save_pretrained(lerobot_dir)  # reads observation.images.corner and a 39-element observation.state
    suite = make_suite(EnvConfig())

    def run_of(policy_config: PolicyConfig) -> RunConfig:
        return RunConfig(policy=policy_config)

    check_features(run_of(smolvla_config(smolvla={"lerobot_checkpoint": str(lerobot_dir)})), suite)  # matches: no error

    def refused(config: PolicyConfig, pattern: str) -> None:
        with pytest.raises(ConfigError, match=pattern) as caught:
            check_features(run_of(config), suite)
        assert "\n" not in str(caught.value)

    refused(smolvla_config(cameras=["corner2"], smolvla={"lerobot_checkpoint": str(lerobot_dir)}),
            r"reads the frames \['observation\.images\.corner'\] .* given \['observation\.images\.corner2'\] .*rename_map")  # fmt: skip
    saved = json.loads((lerobot_dir / "config.json").read_text())
    saved["input_features"]["observation.state"]["shape"] = [8]
    (lerobot_dir / "config.json").write_text(json.dumps(saved))
    refused(smolvla_config(smolvla={"lerobot_checkpoint": str(lerobot_dir)}),
            r"reads a 8-element observation\.state but the run's state has 39 .*\.reinit_state_proj: true")  # fmt: skip
    check_features(run_of(smolvla_config(smolvla={"lerobot_checkpoint": str(lerobot_dir), "reinit_state_proj": True})), suite)
    with pytest.raises(ConfigError, match=r"policy\.cameras \['ceiling'\] are not cameras of metaworld task pick-place-v3"):
        suite.check(smolvla_config(cameras=["ceiling"]))
