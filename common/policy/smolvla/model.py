"""SmolVLA (lerobot's SmolVLAPolicy, 0.4.x or 0.6.x) as a flow policy: camera frames, instruction and state in.

What each FlowPolicy piece reads:
  encode(obs)   runs the VLM prefix ONCE (SigLIP image tokens, instruction tokens, projected state) with
                lerobot's `embed_prefix` (every camera through SigLIP in one batch: vla_common.one_vision_pass; or the
                image tokens a rollout recorded: VLAFlowPolicy.camera_embeddings)
                and its prefix pass (common.policy.lerobot_compat.fill_prefix_cache), and keeps the per-layer
                key/value cache, the prefix pad mask and the critic's input. The kept cache is never mutated by a
                denoising step, so one encode serves all K steps, the critic, and (VLM frozen) every PPO epoch
                and minibatch of an iteration.
  velocity      lerobot's `denoise_step` on that cache: the action expert attends to the prefix and
                `action_out_proj` maps its hidden state to a velocity, converted to the project's time
                convention by common.policy.vla_common.lerobot_flow_time (the only place the two conventions meet).
  sigma         the ReinFlow noise head on the expert's hidden state, i.e. the input of `action_out_proj`
                at the same (a_k, t_k), bounded by a tanh into [log sigma_min^2, log sigma_max^2].
  value         the critic head; see VLAFlowPolicy.value (common.policy.vla_common) for what it reads and why.
  to_lerobot    writes the policy back as a lerobot SmolVLA checkpoint (python -m learner.export).
Actions and state are normalised with buffers saved with the weights (as the MLP backend), and the chain
lives in the first action_dim of lerobot's max_action_dim padded action vector.

Install (docs/smolvla.md): the `smolvla` extra plus `pip install --no-deps lerobot==0.4.4` on Python 3.11, the
`lerobot` extra on Python >= 3.12; where the two lerobot lines differ is common.policy.lerobot_compat. This module is imported only when
policy.type is "smolvla".
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from common.config import PolicyConfig
from common.observation import Observation
from common.policy.base import CONFIG_FILE
from common.policy.smolvla.stand_ins import TinyVLMSpec, tiny_vlm_dir
from common.policy.torchvision_shim import install_cpu_torchvision_shim
from common.storage import CheckpointError
from common.validation import HUB_ID

install_cpu_torchvision_shim()

from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig as LerobotSmolVLAConfig  # noqa: E402
from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy  # noqa: E402

from common.policy.lerobot_compat import (  # noqa: E402
    denoise_cache,
    embed_whole_frames,
    make_att_2d_masks,
    pad_vector,
    resize_with_pad,
    whole_frame_tower,
)
from common.policy.vla_common import (  # noqa: E402
    VLAFeatures,
    VLAFlowPolicy,
    building_lerobot_model,
    grouped_query_attention,
    lerobot_config_fields,
    load_lerobot_checkpoint,
    local_directory,
    one_vision_pass,
    prefix_features,
    require_frames_and_instruction,
    tokenize_texts,
)

# lerobot config.json fields that fix tensor shapes or layer wiring: a lerobot checkpoint must agree with
# policy.smolvla on each of them (field name in lerobot's config -> in policy.smolvla).
LEROBOT_ARCHITECTURE_FIELDS = (
    "num_vlm_layers",
    "num_expert_layers",
    "self_attn_every_n_layers",
    "expert_width_multiplier",
    "max_state_dim",
    "max_action_dim",
)


def resolve_vlm_path(config: PolicyConfig) -> Path:
    """policy.smolvla.vlm_path, or the tiny offline SmolVLM for policy.image_size when it is empty."""
    what = "the SmolVLM backbone's config, processor and tokenizer (e.g. a copy of HuggingFaceTB/SmolVLM2-500M-Video-Instruct)"
    return local_directory(
        config, "smolvla", "vlm_path", "config.json", what, lambda: tiny_vlm_dir(TinyVLMSpec(image_size=config.image_size))
    )


def build_lerobot_config(config: PolicyConfig, vlm_path: Path) -> LerobotSmolVLAConfig:
    """lerobot's SmolVLAConfig for this policy config, with the VLM read from a local directory."""
    vision_size = int(json.loads((vlm_path / "config.json").read_text())["vision_config"]["image_size"])
    smol = config.smolvla
    return LerobotSmolVLAConfig(
        vlm_model_name=str(vlm_path),
        load_vlm_weights=False,  # every tensor comes from our checkpoint or a lerobot checkpoint, strictly
        num_steps=config.num_steps,
        pad_language_to="max_length",
        num_vlm_layers=smol.num_vlm_layers,
        num_expert_layers=smol.num_expert_layers,
        self_attn_every_n_layers=smol.self_attn_every_n_layers,
        expert_width_multiplier=smol.expert_width_multiplier,
        resize_imgs_with_padding=(vision_size, vision_size),
        **lerobot_config_fields(config),
    )


def fused_attention(attention_mask: Tensor, batch_size: int, head_dim: int, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """lerobot's SmolVLM-with-expert `eager_attention_forward` (its arguments after self: a (B, Lq, Lk) bool mask, True where a
    query may attend; (B, Lq, heads, D) queries; (B, Lk, kv_heads, D) keys and values -> (B, Lq, heads x D)) through
    common.policy.vla_common.grouped_query_attention. Masked scores get a finite lowest value, as lerobot sets them: bfloat16's
    lowest, which float32 holds exactly and autocast's cast to bfloat16 keeps finite."""
    bias = torch.zeros(attention_mask.shape, device=query.device).masked_fill_(~attention_mask, torch.finfo(torch.bfloat16).min)
    out = grouped_query_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), bias[:, None], head_dim**-0.5)
    return out.transpose(1, 2).reshape(batch_size, query.shape[1], -1)


def checkpoint_hub_id(lerobot_checkpoint: str) -> str:
    """The hub id a lerobot SmolVLA checkpoint names its backbone by (smolvla_base's vlm_model_name), or "" where it
    names a local directory."""
    name = json.loads((Path(lerobot_checkpoint).expanduser() / CONFIG_FILE).read_text()).get("vlm_model_name", "")
    return name if HUB_ID.fullmatch(name) and not Path(name).expanduser().exists() else ""


class SmolVLAFlowPolicy(VLAFlowPolicy):
    """lerobot's SmolVLAPolicy (attribute `vla`) plus a ReinFlow noise head and a critic head."""

    prefix_groups = ("vlm", "state_proj")  # encode() runs the VLM over images, instruction and the projected state

    def __init__(self, config: PolicyConfig):
        super().__init__()
        config.validate()
        if config.type != "smolvla":
            raise CheckpointError(f"SmolVLAFlowPolicy needs policy.type 'smolvla', got {config.type!r}")
        self.config = copy.deepcopy(config)  # its own: set_trainable changes it, never the caller's run config
        with building_lerobot_model(config, "smolvla"):
            self.vla = SmolVLAPolicy(build_lerobot_config(config, resolve_vlm_path(config)))
        kept_layers = self.vla.model.vlm_with_expert.num_vlm_layers
        if kept_layers != config.smolvla.num_vlm_layers:  # lerobot slices [:n] and silently keeps fewer
            raise CheckpointError(
                f"policy.smolvla.num_vlm_layers={config.smolvla.num_vlm_layers} but the VLM at {self.vla.config.vlm_model_name} "
                f"has only {kept_layers} text layers: set policy.smolvla.num_vlm_layers <= {kept_layers}"
            )
        if config.smolvla.lerobot_checkpoint:
            load_lerobot_checkpoint(self.vla, config, "smolvla", LEROBOT_ARCHITECTURE_FIELDS)
            self.config.smolvla.vlm_hub_id = config.smolvla.vlm_hub_id or checkpoint_hub_id(config.smolvla.lerobot_checkpoint)
        model = self.vla.model
        self.add_heads(model.vlm_with_expert.expert_hidden_size, model.vlm_with_expert.config.text_config.hidden_size)

    # -- what trains -------------------------------------------------------------------------------

    def parameter_groups(self) -> dict[str, tuple[nn.Module, ...]]:
        """Every trainable-flag group (policy.smolvla.train_<group>) -> its modules; they partition the parameters."""
        model = self.vla.model
        return {
            "vlm": (model.vlm_with_expert.vlm,),
            "state_proj": (model.state_proj,),
            "expert": (model.vlm_with_expert.lm_expert,),
            "action_proj": (model.action_in_proj, model.action_out_proj),
            "time_mlp": (model.action_time_mlp_in, model.action_time_mlp_out),
            "noise_head": (self.noise_head,),
            "critic": (self.critic_head,),
        }

    def set_backbone_dtype(self, dtype: torch.dtype) -> SmolVLAFlowPolicy:
        """Cast the VLM and the action expert (actors with actors.speed.precision bfloat16, which also sample under
        torch.autocast); the projections, noise head and critic stay float32, as lerobot expects (it casts
        the expert output to float32 before action_out_proj). Why autocast alone is not enough: its cast
        cache keeps only weights that require grad, so over float32 weights the frozen VLM is recast at
        every encode and the frozen expert at every denoising step (tests/integration/test_smolvla.py counts them), and
        each actor holds the float32 copy. The learner keeps float32; the behaviour-vs-learner log-prob gap
        this opens is a logged metric."""
        self.vla.model.vlm_with_expert.to(dtype)
        return self

    def compiled_vision_tower(self) -> Callable[[Tensor], Tensor]:
        """SigLIP and the connector compiled, on the whole-frame path (embed_whole_frames: encode() always hands the
        tower whole frames, so it is lerobot's embed_image), whose host-read patch ids are looked up outside the graph."""
        return functools.partial(embed_whole_frames, self.vla.model.vlm_with_expert, tower=torch.compile(whole_frame_tower))

    def fuse_attention(self, fused: bool = True) -> None:
        """The VLM's prefix pass and the expert's denoising steps attend through fused_attention (actors.speed.
        fused_attention, learner.speed.fused_attention) from here on, or again through lerobot's eager attention (fused
        False): lerobot asks its model for the attention function at every layer (get_attention_interface), and this
        model's own answer shadows lerobot's method."""
        vlm_with_expert = self.vla.model.vlm_with_expert
        vars(vlm_with_expert).pop("get_attention_interface", None)
        if fused:
            vlm_with_expert.get_attention_interface = lambda: fused_attention

    @property
    def attention_fused(self) -> bool:
        return "get_attention_interface" in vars(self.vla.model.vlm_with_expert)

    @contextlib.contextmanager
    def capture_context(self) -> Iterator[None]:
        """lerobot's embed_image reads the patch mask on the host (common.policy.lerobot_compat.embed_whole_frames);
        frames always reach it whole, at the vision tower's size, where the equivalent path needs no such read."""
        vlm_with_expert = self.vla.model.vlm_with_expert
        vlm_with_expert.embed_image = functools.partial(embed_whole_frames, vlm_with_expert)
        try:
            yield
        finally:
            del vlm_with_expert.embed_image

    # -- inputs ------------------------------------------------------------------------------------

    def tokenize(self, instructions: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Instructions -> (ids (B, L) int64, mask (B, L) bool), L = policy.smolvla.tokenizer_max_length.
        As lerobot's preprocessor: a trailing newline, right padding; padded to a fixed L so every env's
        tokens stack into one record."""
        tokenizer = self.vla.model.vlm_with_expert.processor.tokenizer
        texts = [text if text.endswith("\n") else f"{text}\n" for text in instructions]
        return tokenize_texts(tokenizer, texts, self.config.smolvla.tokenizer_max_length)

    def lerobot_inputs(self, obs: Observation) -> tuple[list[Tensor], list[Tensor], Tensor, Tensor, Tensor]:
        """Observation -> lerobot's (images, image masks, tokens, token mask, padded normalised state).
        Frames: uint8 (B, C, H, W, 3) -> per camera float (B, 3, S, S) in [-1, 1] (SigLIP's range), resized
        with padding to the VLM's image size S as lerobot does; all cameras in one pass, camera after camera, so each
        camera's frames are a view of one (C x B, 3, S, S) tensor. Recorded tokens in place of frames: a placeholder per
        camera (camera_placeholders)."""
        require_frames_and_instruction(obs, self.config)
        batch = obs.state.shape[0]
        if obs.image_embeddings is not None:
            images = self.camera_placeholders(obs)
        else:
            width, height = self.vla.config.resize_imgs_with_padding  # lerobot's order
            cameras = obs.images.shape[1]
            frames = obs.images.transpose(0, 1).reshape(cameras * batch, *obs.images.shape[2:]).permute(0, 3, 1, 2).float() / 255.0
            if tuple(frames.shape[-2:]) != (height, width):
                frames = resize_with_pad(frames, height, width, pad_value=0)
            images = list((frames * 2.0 - 1.0).split(batch))
        masks = [torch.ones(batch, dtype=torch.bool, device=obs.state.device) for _ in images]
        return images, masks, obs.tokens, obs.token_mask, pad_vector(self.normalized_state(obs), self.config.smolvla.max_state_dim)

    # -- the FlowPolicy pieces ---------------------------------------------------------------------

    def encode(self, obs: Observation) -> VLAFeatures:
        """One VLM pass over the prefix (images, instruction, state) -> KV cache, pad mask, critic input."""
        model = self.vla.model
        images, image_masks, tokens, token_mask, state = self.lerobot_inputs(obs)
        embedded = self.camera_embeddings(obs, images, model.vlm_with_expert)
        with one_vision_pass(model.vlm_with_expert, images, embedded):
            embeddings, pad_mask, att_mask = model.embed_prefix(images, image_masks, tokens, token_mask, state=state)
        attention = make_att_2d_masks(pad_mask, att_mask)
        return prefix_features(
            model.vlm_with_expert,
            embeddings,
            pad_mask,
            attention,
            state[:, : self.config.obs_dim],
            image_embeddings=self.kept_image_embeddings(embedded),
        )

    def denoise(self, features: VLAFeatures, action: Tensor, lerobot_t: Tensor) -> Tensor:
        model = self.vla.model
        return model.denoise_step(features.prefix_pad_mask, denoise_cache(model.vlm_with_expert, features.kv()), action, lerobot_t)

    def lerobot_summary(self, files: str) -> str:
        return f"backbone and tokenizer {files}"

    def lerobot_files(self) -> Path:
        return Path(self.vla.config.vlm_model_name)

    def lerobot_hub_id(self) -> str | None:
        return self.config.smolvla.vlm_hub_id or None

    def name_on_hub(self, lerobot_config: Any, preprocessor: Any, hub_id: str) -> None:
        super().name_on_hub(lerobot_config, preprocessor, hub_id)
        lerobot_config.vlm_model_name = hub_id

    @classmethod
    def from_pretrained(cls, directory: str | Path, vlm_path: str | None = None, **overrides: Any) -> SmolVLAFlowPolicy:
        """Strict load (every tensor from the file, or CheckpointError naming the missing ones). `vlm_path`
        replaces the saved backbone directory (which only supplies the VLM's config and tokenizer: its
        weights are in the checkpoint)."""
        return cls.load_with_local_path(directory, "vlm_path", vlm_path, **overrides)
