"""SmolVLA (lerobot's SmolVLAPolicy, 0.4.x or 0.6.x) as a flow policy: camera frames, instruction and state in.

What each FlowPolicy piece reads:
  encode(obs)   runs the VLM prefix ONCE (SigLIP image tokens, instruction tokens, projected state) with
                lerobot's `embed_prefix` and its prefix pass (common.policy.lerobot_compat.fill_prefix_cache),
                and keeps the per-layer key/value cache, the prefix pad mask and the critic's input. The kept
                cache is never mutated by a denoising step, so one encode serves all K steps, the critic, and
                (VLM frozen) every PPO epoch and minibatch of an iteration.
  velocity      lerobot's `denoise_step` on that cache: the action expert attends to the prefix and
                `action_out_proj` maps its hidden state to a velocity, converted to the project's time
                convention by `lerobot_flow_time` (the only place the two conventions meet).
  sigma         the ReinFlow noise head on the expert's hidden state, i.e. the input of `action_out_proj`
                at the same (a_k, t_k), bounded by a tanh into [log sigma_min^2, log sigma_max^2].
  value         the critic head; see SmolVLAFlowPolicy.value for what it reads and why.
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
import dataclasses
import functools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from common.config import PolicyConfig
from common.observation import Observation
from common.policy.base import CONFIG_FILE, WEIGHTS_FILE, CheckpointError, FlowPolicy, read_policy_config, read_safetensors
from common.policy.mlp import mlp
from common.policy.tiny_vlm import TinyVLMSpec, tiny_vlm_dir
from common.policy.torchvision_shim import install_cpu_torchvision_shim

install_cpu_torchvision_shim()

from lerobot.configs.types import FeatureType, PolicyFeature  # noqa: E402
from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig as LerobotSmolVLAConfig  # noqa: E402
from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy  # noqa: E402
from lerobot.utils.constants import ACTION, OBS_IMAGES, OBS_STATE  # noqa: E402

from common.policy.lerobot_compat import (  # noqa: E402
    KVLayers,
    denoise_cache,
    embed_whole_frames,
    fill_prefix_cache,
    make_att_2d_masks,
    pad_vector,
    resize_with_pad,
)  # fmt: skip

# lerobot config.json fields that fix tensor shapes or layer wiring: a lerobot checkpoint must agree with
# policy.smolvla on each of them (field name in lerobot's config -> in policy.smolvla).
LEROBOT_ARCHITECTURE_FIELDS = (
    "num_vlm_layers", "num_expert_layers", "self_attn_every_n_layers", "expert_width_multiplier", "max_state_dim", "max_action_dim",
)  # fmt: skip
STATE_PROJ_PREFIX = "model.state_proj."  # lerobot's state projection, (hidden, max_state_dim) + bias, in a lerobot state dict


def lerobot_flow_time(t: Tensor) -> tuple[Tensor, float]:
    """The ONE map between the project's flow time and lerobot's: t (B,) -> (lerobot time (B,), velocity sign).

    The project (common.flow.time_grid) runs t from 0 (noise) to 1 (action): a_t = (1 - t) noise + t action,
    a_{k+1} = a_k + v dt with dt = +1/K. lerobot's SmolVLA runs tau from 1 (noise) to 0 (action):
    x_tau = tau noise + (1 - tau) action, its network predicts u = noise - action, and it steps
    x <- x + u * (-1/K). So a_t = x_{1-t}, and the project's velocity da/dt = -dx/dtau = -u. With the
    noise off, K Euler steps of the project's chain are then exactly lerobot's `sample_actions`.
    """
    return 1.0 - t, -1.0


def bounded_sigma(raw: Tensor, sigma_min: float, sigma_max: float) -> Tensor:
    """ReinFlow's noise bound: raw head output -> std with log std^2 = tanh-interpolated in [log min^2, log max^2]."""
    log_var_min, log_var_max = 2.0 * math.log(sigma_min), 2.0 * math.log(sigma_max)
    log_var = log_var_min + 0.5 * (torch.tanh(raw) + 1.0) * (log_var_max - log_var_min)
    return torch.exp(0.5 * log_var)


@dataclass
class SmolVLAFeatures:
    """encode()'s output: everything the K denoising steps and the critic need, batch first."""

    key_states: tuple[Tensor, ...]  # per VLM layer (B, L, kv_heads, head_dim): the prefix KV cache
    value_states: tuple[Tensor, ...]  # per VLM layer (B, L, kv_heads, head_dim)
    prefix_pad_mask: Tensor  # (B, L) bool, True on real prefix tokens (images, instruction, state)
    critic_input: Tensor  # (B, text_hidden + obs_dim): pooled prefix hidden state and normalised state
    # (t, expert hidden state (B, H, expert_width)) of the last velocity() call on these features, read by
    # the sigma() call that follows it. Not an init field: index_features' copies start without it.
    last_expert_hidden: tuple[Tensor, Tensor] | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def kv(self) -> KVLayers:
        """The kept prefix cache as common.policy.lerobot_compat takes it."""
        return self.key_states, self.value_states


@contextlib.contextmanager
def capture_input(module: nn.Module) -> Iterator[list[Tensor]]:
    """Record the input of every forward of `module` while the context is open (lerobot's denoise_step
    returns only the velocity; the noise head needs the expert hidden state it was computed from)."""
    captured: list[Tensor] = []
    handle = module.register_forward_pre_hook(lambda _module, args: captured.append(args[0]))
    try:
        yield captured
    finally:
        handle.remove()


def resolve_vlm_path(config: PolicyConfig) -> Path:
    """policy.smolvla.vlm_path, or the tiny offline SmolVLM for policy.image_size when it is empty."""
    if not config.smolvla.vlm_path:
        return tiny_vlm_dir(TinyVLMSpec(image_size=config.image_size))
    path = Path(config.smolvla.vlm_path).expanduser()
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"policy.smolvla.vlm_path={config.smolvla.vlm_path!r} holds no config.json: it must be a local directory with the "
            "SmolVLM backbone's config, processor and tokenizer (e.g. a copy of HuggingFaceTB/SmolVLM2-500M-Video-Instruct)"
        )
    return path


def build_lerobot_config(config: PolicyConfig, vlm_path: Path) -> LerobotSmolVLAConfig:
    """lerobot's SmolVLAConfig for this policy config, with the VLM read from a local directory."""
    vision_size = int(json.loads((vlm_path / "config.json").read_text())["vision_config"]["image_size"])
    smol = config.smolvla
    images = {
        f"observation.images.{camera}": PolicyFeature(FeatureType.VISUAL, (3, config.image_size, config.image_size))
        for camera in config.cameras
    }
    return LerobotSmolVLAConfig(
        vlm_model_name=str(vlm_path),
        load_vlm_weights=False,  # every tensor comes from our checkpoint or a lerobot checkpoint, strictly
        chunk_size=config.chunk_size,
        n_action_steps=config.chunk_size,
        num_steps=config.num_steps,
        max_state_dim=smol.max_state_dim,
        max_action_dim=smol.max_action_dim,
        tokenizer_max_length=smol.tokenizer_max_length,
        pad_language_to="max_length",
        num_vlm_layers=smol.num_vlm_layers,
        num_expert_layers=smol.num_expert_layers,
        self_attn_every_n_layers=smol.self_attn_every_n_layers,
        expert_width_multiplier=smol.expert_width_multiplier,
        # lerobot's own freezing (requires_grad is set again by apply_trainable_flags). With the VLM trained,
        # lerobot's train() no longer keeps the VLM in eval mode: SmolVLAFlowPolicy.train() does.
        freeze_vision_encoder=not smol.train_vlm,
        train_expert_only=not smol.train_vlm,
        resize_imgs_with_padding=(vision_size, vision_size),
        input_features={"observation.state": PolicyFeature(FeatureType.STATE, (config.obs_dim,)), **images},
        output_features={"action": PolicyFeature(FeatureType.ACTION, (config.action_dim,))},
        device="cpu",  # lerobot uses it for its processors only; the model moves with .to()
    )


class SmolVLAFlowPolicy(FlowPolicy):
    """lerobot's SmolVLAPolicy (attribute `vla`) plus a ReinFlow noise head and a critic head."""

    lerobot_type = "smolvla"

    def __init__(self, config: PolicyConfig):
        super().__init__()
        config.validate()
        if config.type != "smolvla":
            raise CheckpointError(f"SmolVLAFlowPolicy needs policy.type 'smolvla', got {config.type!r}")
        self.config = copy.deepcopy(config)  # its own: set_trainable changes it, never the caller's run config
        self.vla = SmolVLAPolicy(build_lerobot_config(config, resolve_vlm_path(config)))
        kept_layers = self.vla.model.vlm_with_expert.num_vlm_layers
        if kept_layers != config.smolvla.num_vlm_layers:  # lerobot slices [:n] and silently keeps fewer
            raise CheckpointError(
                f"policy.smolvla.num_vlm_layers={config.smolvla.num_vlm_layers} but the VLM at {self.vla.config.vlm_model_name} "
                f"has only {kept_layers} text layers: set policy.smolvla.num_vlm_layers <= {kept_layers}"
            )
        if config.smolvla.lerobot_checkpoint:
            load_lerobot_checkpoint(self.vla, config)
        model = self.vla.model
        expert_width = model.vlm_with_expert.expert_hidden_size
        text_width = model.vlm_with_expert.config.text_config.hidden_size
        # The noise head reads the expert hidden state of each action token (B, H, expert_width).
        self.noise_head = mlp(expert_width, config.hidden_dim, config.action_dim, 2)
        self.critic_head = mlp(text_width + config.obs_dim, config.hidden_dim, 1, 2)
        self.register_normalization()  # as the MLP backend: buffers saved with the weights
        self.apply_trainable_flags()
        self.eval()

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

    def apply_trainable_flags(self) -> None:
        """requires_grad from policy.smolvla.train_* (lerobot's own freezing choices are overridden)."""
        flags = self.config.smolvla
        for group, modules in self.parameter_groups().items():
            for module in modules:
                module.requires_grad_(getattr(flags, f"train_{group}"))

    def set_trainable(self, **flags: bool) -> None:
        """Change what trains, e.g. set_trainable(train_expert=True, train_vlm=True) for behaviour cloning.
        The flags are a run setting, not architecture: a checkpoint stores the ones it was saved with, so a
        run that loads one applies its own policy.smolvla.train_* through this method."""
        known = {f"train_{group}" for group in self.parameter_groups()}
        unknown = sorted(set(flags) - known)
        if unknown:
            raise ValueError(f"unknown trainable flag(s) {unknown}; known: policy.smolvla.{sorted(known)}")
        self.config.smolvla = dataclasses.replace(self.config.smolvla, **flags)
        self.apply_trainable_flags()

    @property
    def encoder_is_trainable(self) -> bool:
        """encode() runs the VLM and state_proj; with both frozen its features are fixed per observation."""
        groups = self.parameter_groups()
        return any(p.requires_grad for m in groups["vlm"] + groups["state_proj"] for p in m.parameters())

    def broadcast_bytes(self) -> int:
        """Bytes sent to actors per weight version (the trainable tensors only)."""
        return sum(t.numel() * t.element_size() for t in self.broadcast_state().values())

    def set_backbone_dtype(self, dtype: torch.dtype) -> SmolVLAFlowPolicy:
        """Cast the VLM and the action expert (actors with actors.precision bfloat16, which also sample under
        torch.autocast); the projections, noise head and critic stay float32, as lerobot expects (it casts
        the expert output to float32 before action_out_proj). Why autocast alone is not enough: its cast
        cache keeps only weights that require grad, so over float32 weights the frozen VLM is recast at
        every encode and the frozen expert at every denoising step (tests/test_smolvla.py counts them), and
        each actor holds the float32 copy. The learner keeps float32; the behaviour-vs-learner log-prob gap
        this opens is a logged metric."""
        self.vla.model.vlm_with_expert.to(dtype)
        return self

    def train(self, mode: bool = True) -> SmolVLAFlowPolicy:
        """Heads follow `mode`; the lerobot model stays in eval mode whatever is asked. A known failure: a wrapper's
        .train() switched SmolVLA's dropout on, so recomputed log-probs differed from the behaviour ones by
        hundreds of nats before any update (KL ~3e8). Eval mode only turns dropout off: gradients still flow."""
        super().train(mode)
        self.vla.eval()
        return self

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
        length = self.config.smolvla.tokenizer_max_length
        encoded = tokenizer(texts, padding="max_length", max_length=length, truncation=True, padding_side="right", return_tensors="np")
        return encoded["input_ids"].astype(np.int64), encoded["attention_mask"].astype(bool)

    def lerobot_inputs(self, obs: Observation) -> tuple[list[Tensor], list[Tensor], Tensor, Tensor, Tensor]:
        """Observation -> lerobot's (images, image masks, tokens, token mask, padded normalised state).
        Frames: uint8 (B, C, H, W, 3) -> per camera float (B, 3, S, S) in [-1, 1] (SigLIP's range), resized
        with padding to the VLM's image size S as lerobot does."""
        missing = [name for name in ("images", "tokens") if getattr(obs, name) is None]
        if missing:
            raise ValueError(
                f"SmolVLA reads camera frames and the instruction, but Observation.{'/'.join(missing)} is None: render "
                f"policy.image_size={self.config.image_size} frames from {self.config.cameras}; tokenize instructions with policy.tokenize"
            )
        if obs.images.shape[1] != len(self.config.cameras):
            raise ValueError(f"Observation.images has {obs.images.shape[1]} cameras, policy.cameras lists {len(self.config.cameras)}")
        width, height = self.vla.config.resize_imgs_with_padding  # lerobot's order
        images = []
        for camera in range(obs.images.shape[1]):
            frame = obs.images[:, camera].permute(0, 3, 1, 2).float() / 255.0
            if tuple(frame.shape[-2:]) != (height, width):
                frame = resize_with_pad(frame, height, width, pad_value=0)
            images.append(frame * 2.0 - 1.0)
        masks = [torch.ones(obs.state.shape[0], dtype=torch.bool, device=obs.state.device) for _ in images]
        return images, masks, obs.tokens, obs.token_mask, pad_vector(self.normalized_state(obs), self.config.smolvla.max_state_dim)

    # -- the FlowPolicy pieces ---------------------------------------------------------------------

    def encode(self, obs: Observation) -> SmolVLAFeatures:
        """One VLM pass over the prefix (images, instruction, state) -> KV cache, pad mask, critic input."""
        model = self.vla.model
        images, image_masks, tokens, token_mask, state = self.lerobot_inputs(obs)
        embeddings, pad_mask, att_mask = model.embed_prefix(images, image_masks, tokens, token_mask, state=state)
        attention, positions = make_att_2d_masks(pad_mask, att_mask), torch.cumsum(pad_mask, dim=1) - 1  # as lerobot's sample_actions
        prefix_out, (key_states, value_states) = fill_prefix_cache(model.vlm_with_expert, embeddings, attention, positions)
        weights = pad_mask.unsqueeze(-1).to(prefix_out.dtype)
        pooled = (prefix_out * weights).sum(1) / weights.sum(1).clamp_min(1.0)
        return SmolVLAFeatures(
            key_states=key_states,
            value_states=value_states,
            prefix_pad_mask=pad_mask,
            critic_input=torch.cat([pooled.float(), state[:, : self.config.obs_dim].float()], dim=-1),
        )

    def velocity(self, action: Tensor, t: Tensor, features: SmolVLAFeatures) -> Tensor:
        """lerobot's denoise_step at (a_t, t), mapped to the project's convention; (B, H, A)."""
        model = self.vla.model
        lerobot_t, sign = lerobot_flow_time(t)
        padded = pad_vector(action, self.config.smolvla.max_action_dim)
        with capture_input(model.action_out_proj) as hidden:
            v = model.denoise_step(features.prefix_pad_mask, denoise_cache(model.vlm_with_expert, features.kv()), padded, lerobot_t)
        features.last_expert_hidden = (t, hidden[-1])
        return sign * v[..., : self.config.action_dim]

    def sigma(self, t: Tensor, features: SmolVLAFeatures) -> Tensor:
        """Injected-noise std (B, H, A) from the expert hidden state of the velocity() call just before,
        at the same t and features (common.flow.transition calls them in that order). The head sees the
        noisy action through that hidden state, which the interface's sigma(t, features) does not pass."""
        stash, features.last_expert_hidden = features.last_expert_hidden, None
        if stash is None or stash[0] is not t:
            raise RuntimeError(
                "SmolVLAFlowPolicy.sigma(t, features) reads the expert hidden state of the velocity(action, t, features) call "
                "made just before it with the same t and features objects (as common.flow.transition does); call velocity first"
            )
        return bounded_sigma(self.noise_head(stash[1]), self.config.sigma_min, self.config.sigma_max)

    def value(self, features: SmolVLAFeatures) -> Tensor:
        """Critic (B,) on the masked mean of the VLM's final prefix hidden states (images, instruction and
        state tokens) concatenated with the normalised state. Both come out of encode's single prefix pass,
        so the critic costs one small MLP; with the VLM frozen they are a fixed feature of the observation,
        which the learner computes once per iteration and reuses. The raw state is added because a pooled
        VLM vector need not keep exact positions, which a value of a pick-and-place state depends on."""
        return self.critic_head(features.critic_input).squeeze(-1)

    def critic_parameter_names(self) -> list[str]:
        return [f"critic_head.{name}" for name, _ in self.critic_head.named_parameters()]

    # -- persistence ---------------------------------------------------------------------------------

    def save_pretrained(self, directory: str | Path) -> Path:
        """As FlowPolicy, with policy.smolvla.lerobot_checkpoint cleared in config.json: the saved weights
        hold every tensor, so loading never reads the original lerobot checkpoint again."""
        directory = super().save_pretrained(directory)
        data = json.loads((directory / CONFIG_FILE).read_text())
        data["smolvla"]["lerobot_checkpoint"] = ""
        data["smolvla"]["reinit_state_proj"] = False  # applied at that load; the saved state_proj is the one to keep
        (directory / CONFIG_FILE).write_text(json.dumps(data, indent=2, sort_keys=True))
        return directory

    def to_lerobot(self, directory: Path) -> dict[str, list[str]]:
        """lerobot's SmolVLAPolicy checkpoint of this policy: its config (the backbone at this policy's local VLM
        directory) and weights as lerobot saves them, padded action elements neutralised (lerobot_sampling_copy),
        the noise head and critic left out; and its processor pipelines as lerobot builds them, with the
        project's state and action mean and std as the statistics of lerobot's MEAN_STD normaliser (frames are
        not normalised, on either side). lerobot's pipeline then maps env-unit state to the state this policy
        reads, and its normalised chunk to env units, as normalized_state and to_env_action do, except for their
        clips (normalised state to +-OBS_CLIP, actions to [-1, 1]), which lerobot's normaliser does not apply."""
        from lerobot.policies.factory import make_pre_post_processors  # imports every lerobot policy's config: only here

        vla = lerobot_sampling_copy(self.vla, self.config.action_dim)
        vla.save_pretrained(directory)
        stats = {
            OBS_STATE: {"mean": self.obs_mean.detach().cpu().numpy(), "std": self.obs_std.detach().cpu().numpy()},
            ACTION: {"mean": self.action_mean.detach().cpu().numpy(), "std": self.action_std.detach().cpu().numpy()},
        }
        preprocessor, postprocessor = make_pre_post_processors(vla.config, dataset_stats=stats)
        for pipeline in (preprocessor, postprocessor):
            pipeline.save_pretrained(directory)
        written = sorted(path.name for path in Path(directory).iterdir())
        cameras = ", ".join(f"{OBS_IMAGES}.{camera}" for camera in self.config.cameras)
        side = self.config.image_size
        return {
            f"SmolVLAConfig: backbone {vla.config.vlm_model_name}; {OBS_STATE} ({self.config.obs_dim},), {cameras} (3, {side}, {side}), "
            f"{ACTION} ({self.config.action_dim},); chunk {self.config.chunk_size}, {self.config.num_steps} steps": [CONFIG_FILE],
            f"SmolVLAPolicy weights, {len(vla.state_dict())} tensors (the noise head and critic left out)": [WEIGHTS_FILE],
            "preprocessor: the backbone's tokenizer; the project's state (and action) mean and std": [
                name for name in written if name.startswith(preprocessor.name)
            ],
            "postprocessor: the project's action mean and std, to env units": [
                name for name in written if name.startswith(postprocessor.name)
            ],
        }

    @classmethod
    def from_pretrained(cls, directory: str | Path, vlm_path: str | None = None, **overrides: Any) -> SmolVLAFlowPolicy:
        """Strict load (every tensor from the file, or CheckpointError naming the missing ones). `vlm_path`
        replaces the saved backbone directory (which only supplies the VLM's config and tokenizer: its
        weights are in the checkpoint)."""
        if vlm_path is not None:
            saved = dataclasses.asdict(read_policy_config(directory).smolvla)
            overrides["smolvla"] = {**saved, **overrides.get("smolvla", {}), "vlm_path": vlm_path}
        return super().from_pretrained(directory, **overrides)


def lerobot_sampling_copy(vla: SmolVLAPolicy, action_dim: int) -> SmolVLAPolicy:
    """A copy of `vla` whose padded action elements (action_dim onward, up to max_action_dim) do not reach the
    expert: action_in_proj's columns for them are zero.

    The project's chain holds those elements at zero (velocity pads a_t with zeros and reads back the first
    action_dim), so these columns never touch what it computes. lerobot's sample_actions integrates all
    max_action_dim elements, from noise it draws for all of them, and feeds them back through action_in_proj: with
    the columns as trained, its first action_dim would follow another chain. Without them it is the project's
    (what lerobot integrates in the padded elements is sliced off its output)."""
    vla = copy.deepcopy(vla)
    with torch.no_grad():
        vla.model.action_in_proj.weight[:, action_dim:] = 0.0
    return vla


def load_lerobot_checkpoint(vla: SmolVLAPolicy, config: PolicyConfig) -> None:
    """Load a lerobot SmolVLA checkpoint directory (config.json + model.safetensors) into `vla`, strictly.

    lerobot's own loader leaves any tensor missing from the file at its random initialisation without a
    word; here every tensor of the model must come from the file, or CheckpointError lists the missing
    ones. The checkpoint's architecture fields must agree with policy.smolvla (the error says which to
    set). Its `vlm_model_name` (a hub id) is ignored: policy.smolvla.vlm_path supplies the backbone.
    Keys the model does not have (e.g. normalisation buffers older lerobot versions stored) are ignored.

    policy.smolvla.reinit_state_proj: the one explicit exception. smolvla_base's state projection is 32 wide
    (its max_state_dim) and Metaworld's state has 39 elements; with the flag, `model.state_proj.*` keeps its
    fresh initialisation at policy.smolvla.max_state_dim (the file's copy, of another width or absent, is
    not read) and max_state_dim may differ from the file's. Every other tensor is still required from the
    file. The robot state the checkpoint was trained on has other elements than Metaworld's, so its columns
    are not reused; behaviour cloning (learner/pretrain.py) trains the new projection.
    """
    directory = Path(config.smolvla.lerobot_checkpoint).expanduser()
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise CheckpointError(
                f"policy.smolvla.lerobot_checkpoint: {path} is missing (a lerobot SmolVLA checkpoint has config.json and model.safetensors)"
            )
    saved = json.loads(config_path.read_text())
    if saved.get("type") != "smolvla":
        raise CheckpointError(f"{config_path} is a lerobot {saved.get('type')!r} checkpoint, not smolvla")
    reinit_state_proj = config.smolvla.reinit_state_proj
    mismatched = [
        f"policy.smolvla.{name}={saved[name]!r} (config has {getattr(config.smolvla, name)!r})"
        for name in LEROBOT_ARCHITECTURE_FIELDS
        if name in saved and saved[name] != getattr(config.smolvla, name) and not (reinit_state_proj and name == "max_state_dim")
    ]
    if mismatched:
        state_hint = (
            f"; for a state of another width (policy.obs_dim={config.obs_dim}) keep max_state_dim and set "
            "policy.smolvla.reinit_state_proj: true to re-initialise state_proj alone"
            if any(m.startswith("policy.smolvla.max_state_dim=") for m in mismatched)
            else ""
        )
        raise CheckpointError(f"{config_path}: architecture differs from policy.smolvla; set {', '.join(mismatched)}{state_hint}")
    state = read_safetensors(weights_path)
    own = vla.state_dict()
    fresh = {k for k in own if k.startswith(STATE_PROJ_PREFIX)} if reinit_state_proj else set()  # keep their initialisation
    expected = set(own) - fresh
    missing = sorted(expected - set(state))
    wrong_shape = sorted(
        f"{k}: file {tuple(state[k].shape)} vs model {tuple(own[k].shape)}" for k in expected & set(state) if own[k].shape != state[k].shape
    )
    if missing or wrong_shape:
        raise CheckpointError(
            f"{weights_path} lacks {len(missing)} of the model's {len(expected)} expected tensors and has {len(wrong_shape)} of the wrong "
            f"shape; lerobot would leave these at random init. missing={missing} wrong_shape={wrong_shape}"
        )
    vla.load_state_dict({**{k: own[k] for k in fresh}, **{k: state[k] for k in expected}}, strict=True)
