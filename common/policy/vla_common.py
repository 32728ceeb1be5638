"""What the lerobot VLA backends share (SmolVLA: common.policy.smolvla.model; pi0 / pi0.5: common.policy.pi0.model).

Each wraps a lerobot policy (attribute `vla`) whose model has a VLM prefix, an action expert, and an
`action_out_proj` that maps the expert's hidden state to a velocity. The pieces below are the same for all of them:
  VLAFeatures        encode()'s output: the prefix KV cache as plain tensors, batch first, and the critic's input
  prefix_features    one prefix pass (common.policy.lerobot_compat.fill_prefix_cache) -> VLAFeatures
  one_vision_pass    every camera's frames through the vision tower as one batch, inside lerobot's embed_prefix
  grouped_query_attention  attention with key-value heads shared by groups of query heads, as one fused kernel
                     (each backend's fuse_attention: actors.speed.fused_attention, learner.speed.fused_attention)
  lerobot_flow_time  the ONE map between the project's flow time and lerobot's
  VLAFlowPolicy      velocity (the model's denoise_step on a fresh cache per call), the ReinFlow noise head on
                     the expert hidden state, the critic, trainable-flag groups, eval-mode guard, the vision tower
                     compiled on request (compile_vision), persistence, and the export back to a lerobot checkpoint
                     (to_lerobot, python -m learner.export)
  load_lerobot_checkpoint  a lerobot checkpoint directory loaded strictly (every tensor from the file)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
from abc import abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from common.config import PolicyConfig
from common.flow import require_kernel_compiler
from common.observation import Observation
from common.policy.base import CONFIG_FILE, WEIGHTS_FILE, FlowPolicy, read_policy_config
from common.policy.initialisation import initialisation_skipped
from common.policy.lerobot_compat import KVLayers, fill_prefix_cache, pad_vector
from common.policy.mlp import mlp
from common.storage import CheckpointError, read_safetensors

STATE_PROJ_PREFIX = "model.state_proj."  # lerobot's state projection, (width, max_state_dim) + bias, in a lerobot state dict


def lerobot_flow_time(t: Tensor) -> tuple[Tensor, float]:
    """The ONE map between the project's flow time and lerobot's: t (B,) -> (lerobot time (B,), velocity sign).

    The project (common.flow.time_grid) runs t from 0 (noise) to 1 (action): a_t = (1 - t) noise + t action,
    a_{k+1} = a_k + v dt with dt = +1/K. lerobot's SmolVLA, pi0 and pi0.5 run tau from 1 (noise) to 0 (action):
    x_tau = tau noise + (1 - tau) action, the network predicts u = noise - action, and the sampler steps
    x <- x + u * (-1/K). So a_t = x_{1-t}, and the project's velocity da/dt = -dx/dtau = -u. With the
    noise off, K Euler steps of the project's chain are then exactly lerobot's `sample_actions`.
    """
    return 1.0 - t, -1.0


def bounded_sigma(raw: Tensor, sigma_min: float, sigma_max: float) -> Tensor:
    """ReinFlow's noise bound: raw head output -> std with log std^2 = tanh-interpolated in [log min^2, log max^2]."""
    log_var_min, log_var_max = 2.0 * math.log(sigma_min), 2.0 * math.log(sigma_max)
    log_var = log_var_min + 0.5 * (torch.tanh(raw) + 1.0) * (log_var_max - log_var_min)
    return torch.exp(0.5 * log_var)


class InputTap:
    """A forward pre-hook that keeps the input of its module's last call (lerobot's denoise_step returns only the
    velocity; the noise head needs the expert hidden state it was computed from). It stays registered for the policy's
    life: a hook added and removed around each step would split a compiled step (actors.speed.compile_steps) into three
    graphs."""

    def __init__(self) -> None:
        self.last: Tensor | None = None

    def __call__(self, _module: nn.Module, args: tuple[Tensor, ...]) -> None:
        self.last = args[0]

    def take(self) -> Tensor:
        """The input kept, released here (in the learner it carries the step's autograd graph)."""
        kept, self.last = self.last, None
        if kept is None:
            raise RuntimeError("the tapped module has not run since its input was last taken")
        return kept


@dataclass
class VLAFeatures:
    """encode()'s output: everything the K denoising steps and the critic need, batch first."""

    key_states: tuple[Tensor, ...]  # per VLM layer (B, L, kv_heads, head_dim): the prefix KV cache
    value_states: tuple[Tensor, ...]  # per VLM layer (B, L, kv_heads, head_dim)
    prefix_pad_mask: Tensor  # (B, L) bool, True on real prefix tokens
    critic_input: Tensor  # (B, text_hidden + obs_dim): pooled prefix hidden state and normalised state
    # What the expert reads beside the cache at every step: pi0's padded normalised state (B, max_state_dim); None
    # for the backends that put the state into the prefix (SmolVLA's state token, pi0.5's prompt).
    suffix_state: Tensor | None = None
    # (B, C, T, D) the vision tower's tokens of every camera's frame, kept only for a rollout actor that records them in
    # place of the frames (VLAFlowPolicy.send_image_embeddings); None otherwise.
    image_embeddings: Tensor | None = None

    def kv(self) -> KVLayers:
        """The kept prefix cache as common.policy.lerobot_compat takes it."""
        return self.key_states, self.value_states


def prefix_features(
    vlm_with_expert: nn.Module,
    embeddings: Tensor,
    pad_mask: Tensor,
    attention_mask: Tensor,
    state: Tensor,
    suffix_state: Tensor | None = None,
    image_embeddings: Tensor | None = None,
) -> VLAFeatures:
    """One VLM pass over the prefix embeddings (B, L, text_hidden) with the attention mask the model's own sampler
    builds, positions as its sampler counts them -> the kept cache, and the critic input: the masked mean of the final
    prefix hidden states concatenated with the normalised state (B, obs_dim). `image_embeddings` are kept as given."""
    positions = torch.cumsum(pad_mask, dim=1) - 1  # as lerobot's sample_actions
    prefix_out, (key_states, value_states) = fill_prefix_cache(vlm_with_expert, embeddings, attention_mask, positions)
    weights = pad_mask.unsqueeze(-1).to(prefix_out.dtype)
    pooled = (prefix_out * weights).sum(1) / weights.sum(1).clamp_min(1.0)
    return VLAFeatures(
        key_states=key_states,
        value_states=value_states,
        prefix_pad_mask=pad_mask,
        critic_input=torch.cat([pooled.float(), state.float()], dim=-1),
        suffix_state=suffix_state,
        image_embeddings=image_embeddings,
    )


@contextlib.contextmanager
def one_vision_pass(owner: nn.Module, images: list[Tensor], embedded: Tensor) -> Iterator[None]:
    """lerobot's embed_prefix calls `owner.embed_image` once per camera, a vision tower pass over that camera's B
    frames. Inside this context each of those calls, which must come in camera order with these very tensors, is handed
    its camera's share of `embedded` (C x B, T, D), every camera's tokens camera after camera: one tower pass over all
    the frames (VLAFlowPolicy.camera_embeddings), or tokens a rollout recorded. The tower embeds every frame on its own,
    so only the batch changes: C times fewer kernel launches for the tower, whose matmuls are C times taller
    (tests/integration/test_smolvla.py and test_pi0.py check the prefix against lerobot's loop)."""
    pending = list(zip(images, embedded.split([image.shape[0] for image in images]), strict=True))

    def handed_out(image: Tensor) -> Tensor:
        if not pending or pending[0][0] is not image:
            raise RuntimeError("one_vision_pass: embed_image was called with frames other than the next camera's, in camera order")
        return pending.pop(0)[1]

    replaced = vars(owner).get("embed_image")  # a capture_context's own, put back on exit
    owner.embed_image = handed_out
    try:
        yield
    finally:
        if replaced is None:
            del owner.embed_image
        else:
            owner.embed_image = replaced
    if pending:
        raise RuntimeError(f"one_vision_pass: {len(pending)} camera(s) embedded but never asked for by embed_prefix")


def grouped_query_attention(query: Tensor, key: Tensor, value: Tensor, bias: Tensor, scale: float) -> Tensor:
    """Queries (B, heads, Lq, D) over keys and values (B, kv_heads, Lk, D), query head h reading key-value head
    h // (heads / kv_heads) as the eager paths' repeat of keys and values does, under an additive bias broadcastable
    to (B, 1, Lq, Lk) -> (B, heads, Lq, D), as one torch scaled_dot_product_attention.

    The eager paths copy every key and value once per query head, form every (query, key) score as a float32 tensor
    and keep those for the backward pass. Here the query heads that share a key-value head are laid side by side along
    the query axis, so each key and value is read where it is and a fused kernel never holds the scores whole. The
    bias must hold finite values where a query may not look (the backends' masks do): a query whose keys are all
    masked then averages every value, as the eager softmax over finite scores does, where -inf would give NaN."""
    batch, heads, queries, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    dtype = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
    # Head h = kv_head x groups + g (the eager repeat's order) -> row g x Lq + q of its key-value head.
    folded = query.to(dtype).reshape(batch, kv_heads, groups * queries, dim)
    bias = bias.to(dtype).expand(batch, 1, queries, key.shape[2])
    bias = bias[:, :, None].expand(-1, -1, groups, -1, -1).flatten(2, 3)  # each group's rows under the same bias
    out = nn.functional.scaled_dot_product_attention(folded, key.to(dtype), value.to(dtype), attn_mask=bias, scale=scale)
    return out.reshape(batch, heads, queries, dim)  # a GPU kernel may return its rows in another layout


def local_directory(config: PolicyConfig, section: str, field: str, marker: str, what: str, offline: Callable[[], Path]) -> Path:
    """policy.<section>.<field>: a local directory holding `marker` (a CheckpointError saying it must hold `what`
    otherwise), or `offline()` (a stand-in built without network) when the field is empty."""
    value = getattr(getattr(config, section), field)
    if not value:
        return offline()
    path = Path(value).expanduser()
    if not (path / marker).is_file():
        raise CheckpointError(f"policy.{section}.{field}={value!r} holds no {marker}: it must be a local directory with {what}")
    return path


def lerobot_config_fields(config: PolicyConfig) -> dict[str, Any]:
    """The fields every lerobot VLA config (SmolVLAConfig, PI0Config, PI05Config) takes from policy config and its
    section alike: the chunk, the padded widths, the prompt length, lerobot's own freezing (requires_grad is set again
    by apply_trainable_flags; with the VLM trained lerobot's train() no longer keeps it in eval mode, and
    VLAFlowPolicy.train() does), and the features (each camera's frame under its key, policy.image_features(); the
    state; the action)."""
    from lerobot.configs.types import FeatureType, PolicyFeature

    section = getattr(config, config.vla_section())
    frame = (3, config.image_size, config.image_size)
    images = {key: PolicyFeature(FeatureType.VISUAL, frame) for key in config.image_features()}
    return {
        "chunk_size": config.chunk_size,
        "n_action_steps": config.chunk_size,
        "max_state_dim": section.max_state_dim,
        "max_action_dim": section.max_action_dim,
        "tokenizer_max_length": section.tokenizer_max_length,
        "freeze_vision_encoder": not section.train_vlm,
        "train_expert_only": not section.train_vlm,
        "input_features": {"observation.state": PolicyFeature(FeatureType.STATE, (config.obs_dim,)), **images},
        "output_features": {"action": PolicyFeature(FeatureType.ACTION, (config.action_dim,))},
        "device": "cpu",  # lerobot moves the model there once (and uses it for its processors); it moves with .to() afterwards
    }


def tokenize_texts(tokenizer: Any, texts: list[str], length: int) -> tuple[np.ndarray, np.ndarray]:
    """Texts -> (ids (B, length) int64, mask (B, length) bool), right-padded to a fixed length as lerobot's
    tokenizer step does, so every env's tokens stack into one record."""
    encoded = tokenizer(texts, padding="max_length", max_length=length, truncation=True, padding_side="right", return_tensors="np")
    return encoded["input_ids"].astype(np.int64), encoded["attention_mask"].astype(bool)


def require_frames_and_instruction(obs: Observation, config: PolicyConfig) -> None:
    """A one-line error unless the observation carries the frames (or their recorded vision-tower tokens) and the
    instruction tokens a VLA reads."""
    seen = "image_embeddings" if obs.image_embeddings is not None else "images"
    missing = [name for name in (seen, "tokens") if getattr(obs, name) is None]
    if missing:
        raise ValueError(
            f"policy.type {config.type} reads camera frames and the instruction, but Observation.{'/'.join(missing)} is None: render "
            f"policy.image_size={config.image_size} frames from {config.cameras}; tokenize instructions with policy.tokenize"
        )
    cameras = getattr(obs, seen).shape[1]
    if cameras != len(config.cameras):
        raise ValueError(f"Observation.{seen} has {cameras} cameras, policy.cameras lists {len(config.cameras)}")


class VLAFlowPolicy(FlowPolicy):
    """A lerobot VLA (attribute `vla`) plus a ReinFlow noise head and a critic head; a backend supplies the model,
    its encode() and one denoising call (`denoise`), and names its parameter groups."""

    section: str  # the policy config section holding this backend's settings and train_* flags ("smolvla", "pi0")
    prefix_groups: tuple[str, ...]  # the parameter groups that feed encode()
    vla: nn.Module
    # The vision tower compiled for this policy, every camera's frames (C x B, 3, S, S) -> their embeddings, as
    # lerobot's embed_image (compile_vision, called by the rollout actor with actors.speed.compile_vision); None: encode()
    # runs lerobot's embed_image eagerly.
    compiled_vision: Callable[[Tensor], Tensor] | None = None
    # encode() keeps the vision tower's tokens of the frames it read in its features (VLAFeatures.image_embeddings), for
    # the rollout to record in place of the frames: set by the rollout actor with actors.speed.send_image_embeddings.
    send_image_embeddings: bool = False

    def add_heads(self, expert_width: int, text_width: int) -> None:
        """The noise head (on the expert hidden state of each action token (B, H, expert_width)), the critic head (on
        the pooled prefix and the state), normalisation buffers, trainable flags, eval mode: the end of __init__."""
        config = self.config
        self.noise_head = mlp(expert_width, config.hidden_dim, config.action_dim, 2)
        self.critic_head = mlp(text_width + config.obs_dim, config.hidden_dim, 1, 2)
        self.expert_hidden = InputTap()  # what action_out_proj reads at each denoising step: the noise head's input
        self.vla.model.action_out_proj.register_forward_pre_hook(self.expert_hidden)
        self.register_normalization()  # as the MLP backend: buffers saved with the weights
        self.apply_trainable_flags()
        self.eval()

    @property
    def section(self) -> str:
        """The name of this backend's policy config section (common.policy.registry)."""
        return self.config.vla_section()

    @property
    def settings(self) -> Any:
        """This backend's policy config section (policy.smolvla, policy.pi0)."""
        return getattr(self.config, self.section)

    def compile_vision(self, field: str) -> None:
        """The vision tower that encode() runs over every camera's frames (one_vision_pass) becomes one torch.compile
        graph, as `field` asks (actors.speed.compile_vision: the actor's decisions; learner.speed.compile_vision: the learner's
        scoring pass). Its matmuls and attention stay library kernels; its layer norms, activations, casts and residual
        sums fuse into far fewer. It compiles at its first call, and once more for a second batch size; its embeddings
        differ from eager ones in float rounding only (tests/helpers/vla_checks.py). Weights changed in place
        (RolloutActor.load_weights, an optimiser step) need no new compile."""
        require_kernel_compiler(self.obs_device.type, field)
        self.compiled_vision = self.compiled_vision_tower()

    @abstractmethod
    def compiled_vision_tower(self) -> Callable[[Tensor], Tensor]:
        """Frames -> embeddings, as lerobot's embed_image, through a vision tower compiled by torch.compile."""

    @abstractmethod
    def fuse_attention(self, fused: bool = True) -> None:
        """The prefix pass and the denoising steps attend through grouped_query_attention from here on
        (actors.speed.fused_attention, learner.speed.fused_attention), or again through the eager attention lerobot
        runs (fused False)."""

    @property
    @abstractmethod
    def attention_fused(self) -> bool:
        """Whether fuse_attention's fused attention is in use."""

    # -- the frames' vision tower tokens -------------------------------------------------------------

    def camera_embeddings(self, obs: Observation, images: list[Tensor], owner: nn.Module) -> Tensor:
        """(C x B, T, D) every camera's vision-tower tokens, camera after camera, as one_vision_pass hands them out: the
        observation's recorded ones where it carries them (actors.speed.send_image_embeddings), else one tower pass over
        the frames of `images` (compiled_vision, or `owner.embed_image` as it is on entry: lerobot's, or a
        capture_context's)."""
        if obs.image_embeddings is not None:
            return obs.image_embeddings.transpose(0, 1).flatten(0, 1)
        return (self.compiled_vision or owner.embed_image)(torch.cat(images))

    def camera_placeholders(self, obs: Observation) -> list[Tensor]:
        """One empty (B, 0) tensor per camera: what lerobot's embed_prefix is handed for each camera where the
        observation's tokens were recorded (it reads only a camera's batch size beside the tokens one_vision_pass hands
        it)."""
        batch = obs.state.shape[0]
        return [obs.state.new_empty(batch, 0) for _ in self.config.cameras]

    def kept_image_embeddings(self, embedded: Tensor) -> Tensor | None:
        """camera_embeddings' (C x B, T, D) as the record holds them, (B, C, T, D) float32, where this policy sends them
        (send_image_embeddings); None otherwise."""
        if not self.send_image_embeddings:
            return None
        return embedded.unflatten(0, (len(self.config.cameras), -1)).transpose(0, 1).float()

    def recorded_image_embeddings(self, features: VLAFeatures) -> Tensor | None:
        return features.image_embeddings

    # -- what trains -------------------------------------------------------------------------------

    @abstractmethod
    def parameter_groups(self) -> dict[str, tuple[nn.Module, ...]]:
        """Every trainable-flag group (policy.<section>.train_<group>) -> its modules; they partition the parameters."""

    def apply_trainable_flags(self) -> None:
        """requires_grad from policy.<section>.train_* (lerobot's own freezing choices are overridden)."""
        for group, modules in self.parameter_groups().items():
            for module in modules:
                module.requires_grad_(getattr(self.settings, f"train_{group}"))

    def set_trainable(self, **flags: bool) -> None:
        """Change what trains, e.g. set_trainable(train_expert=True, train_vlm=True) for behaviour cloning.
        The flags are a run setting, not architecture: a checkpoint stores the ones it was saved with, so a
        run that loads one applies its own policy.<section>.train_* through this method."""
        known = {f"train_{group}" for group in self.parameter_groups()}
        unknown = sorted(set(flags) - known)
        if unknown:
            raise ValueError(f"unknown trainable flag(s) {unknown}; known: policy.{self.section}.{sorted(known)}")
        setattr(self.config, self.section, dataclasses.replace(self.settings, **flags))
        self.apply_trainable_flags()

    @property
    def encoder_is_trainable(self) -> bool:
        """encode() runs the prefix groups only; with them frozen its features are fixed per observation."""
        groups = self.parameter_groups()
        return any(p.requires_grad for group in self.prefix_groups for m in groups[group] for p in m.parameters())

    def broadcast_bytes(self) -> int:
        """Bytes sent to actors per weight version (the trainable tensors only)."""
        return sum(t.numel() * t.element_size() for t in self.broadcast_state().values())

    def train(self, mode: bool = True) -> VLAFlowPolicy:
        """Heads follow `mode`; the lerobot model stays in eval mode whatever is asked. A known failure: a wrapper's
        .train() switched SmolVLA's dropout on, so recomputed log-probs differed from the behaviour ones by
        hundreds of nats before any update (KL ~3e8). Eval mode only turns dropout off: gradients still flow."""
        super().train(mode)
        self.vla.eval()
        return self

    # -- the FlowPolicy pieces ---------------------------------------------------------------------

    @abstractmethod
    def denoise(self, features: VLAFeatures, action: Tensor, lerobot_t: Tensor) -> Tensor:
        """The model's denoise_step: padded action (B, H, max_action_dim) at lerobot time (B,) -> its velocity, in
        lerobot's convention, computed through `vla.model.action_out_proj`."""

    def velocity_with_hidden(self, action: Tensor, t: Tensor, features: VLAFeatures) -> tuple[Tensor, Tensor]:
        """lerobot's denoise_step at (a_t, t), mapped to the project's convention, (B, H, A), and the action expert's
        hidden state of that pass (B, H, expert_width)."""
        lerobot_t, sign = lerobot_flow_time(t)
        padded = pad_vector(action, self.settings.max_action_dim)
        v = self.denoise(features, padded, lerobot_t)
        return sign * v[..., : self.config.action_dim], self.expert_hidden.take()

    def velocity(self, action: Tensor, t: Tensor, features: VLAFeatures) -> Tensor:
        return self.velocity_with_hidden(action, t, features)[0]

    def velocity_and_sigma(self, action: Tensor, t: Tensor, features: VLAFeatures) -> tuple[Tensor, Tensor]:
        """The velocity, and the injected-noise std the noise head reads off the same pass's expert hidden state: the head
        sees the noisy action through it."""
        velocity, hidden = self.velocity_with_hidden(action, t, features)
        return velocity, bounded_sigma(self.noise_head(hidden), self.config.sigma_min, self.config.sigma_max)

    def value(self, features: VLAFeatures) -> Tensor:
        """Critic (B,) on the masked mean of the VLM's final prefix hidden states concatenated with the normalised
        state. Both come out of encode's single prefix pass, so the critic costs one small MLP; with the VLM frozen
        they are a fixed feature of the observation, which the learner computes once per iteration and reuses. The
        raw state is added because a pooled VLM vector need not keep exact positions, which a value of a
        pick-and-place state depends on."""
        return self.critic_head(features.critic_input).squeeze(-1)

    def critic_features(self, features: VLAFeatures) -> VLAFeatures:
        return dataclasses.replace(features, key_states=(), value_states=())  # the critic reads no prefix cache

    def critic_parameter_names(self) -> list[str]:
        return [f"critic_head.{name}" for name, _ in self.critic_head.named_parameters()]

    # -- persistence ---------------------------------------------------------------------------------

    def save_pretrained(self, directory: str | Path, state: dict[str, Tensor] | None = None) -> Path:
        """As FlowPolicy, with policy.<section>.lerobot_checkpoint cleared in config.json: the saved weights
        hold every tensor, so loading never reads the original lerobot checkpoint again."""
        directory = super().save_pretrained(directory, state)
        data = json.loads((directory / CONFIG_FILE).read_text())
        data[self.section]["lerobot_checkpoint"] = ""
        data[self.section]["reinit_state_proj"] = False  # applied at that load; the saved state_proj is the one to keep
        (directory / CONFIG_FILE).write_text(json.dumps(data, indent=2, sort_keys=True))
        return directory

    # -- export to lerobot (python -m learner.export) -------------------------------------------------

    @abstractmethod
    def lerobot_summary(self, files: str) -> str:
        """What lerobot's config names besides the features, for the export's listing: the backbone, and `files` (the
        name its backbone's or tokenizer's files go by in the export)."""

    @abstractmethod
    def lerobot_files(self) -> Path:
        """The local directory of the files lerobot reads by name and the export does not hold (SmolVLA's backbone
        config, processor and tokenizer; pi0's tokenizer)."""

    @abstractmethod
    def lerobot_hub_id(self) -> str | None:
        """The hub id lerobot_files() is a copy of, or None where none is known."""

    def name_on_hub(self, lerobot_config: Any, preprocessor: Any, hub_id: str) -> None:
        """Name lerobot_files() by `hub_id` in lerobot's config and preprocessor, as they are about to be saved (both
        were built on the local files): here the tokenizer step's name."""
        for step in preprocessor.steps:
            if hasattr(step, "tokenizer_name"):
                step.tokenizer_name = hub_id

    def lerobot_state_normalisation(self) -> tuple[str, dict[str, np.ndarray]]:
        """(lerobot's NormalizationMode name, its statistics) under which lerobot's normaliser turns env-unit state into
        the state this model reads: by default MEAN_STD with the project's mean and std (normalized_state, bar its clip)."""
        return "MEAN_STD", {"mean": self.obs_mean.detach().cpu().numpy(), "std": self.obs_std.detach().cpu().numpy()}

    def lerobot_processors(self, lerobot_config: Any, stats: dict[str, dict[str, np.ndarray]]) -> tuple[Any, Any]:
        """lerobot's preprocessor and postprocessor pipelines for `lerobot_config` with dataset statistics `stats`, as its
        make_pre_post_processors builds them."""
        from lerobot.policies.factory import make_pre_post_processors  # imports every lerobot policy's config: only here

        return make_pre_post_processors(lerobot_config, dataset_stats=stats)

    def hold_padded_actions(self) -> int:
        """This policy's lerobot model sampled by lerobot as by the project (hold_padded_actions), in place; returns how
        many padded elements reached the expert before."""
        return hold_padded_actions(self.vla, self.config.action_dim)

    def to_lerobot(self, directory: Path, hub_id: str | None = None) -> dict[str, list[str]]:
        """lerobot's policy checkpoint of this policy: its config and weights as lerobot saves them, padded action elements
        neutralised (lerobot_sampling_copy), the noise head and critic left out; and its processor pipelines as lerobot
        builds them, with the project's normalisation as the statistics of lerobot's normaliser: the action's mean and
        std (MEAN_STD), the state's as lerobot_state_normalisation says; frames are not normalised, on either side.
        lerobot's pipeline then maps env-unit state to the state this policy reads, and its normalised chunk to env
        units (policy.action_bounds), as normalized_state, to_env_action and the suite do, except for their clips
        (normalised state to +-OBS_CLIP, actions to [-1, 1]), which lerobot's normaliser does not apply. The files
        lerobot reads by name (lerobot_files) are named by `hub_id` where given, so that the export loads wherever the
        hub or its cache holds them; else by their directory on this machine."""
        from lerobot.configs.types import NormalizationMode
        from lerobot.utils.constants import ACTION, OBS_STATE

        vla = lerobot_sampling_copy(self.vla, self.config.action_dim)
        state_mode, state_stats = self.lerobot_state_normalisation()
        vla.config.normalization_mapping = {
            "VISUAL": NormalizationMode.IDENTITY,
            "STATE": NormalizationMode[state_mode],
            "ACTION": NormalizationMode.MEAN_STD,
        }
        centre, half_width = self.config.action_units()  # to the env's units
        action_mean, action_std = self.action_mean.detach().cpu().numpy(), self.action_std.detach().cpu().numpy()
        action_stats = {"mean": action_mean * half_width + centre, "std": action_std * half_width}
        preprocessor, postprocessor = self.lerobot_processors(vla.config, {OBS_STATE: state_stats, ACTION: action_stats})
        if hub_id:
            self.name_on_hub(vla.config, preprocessor, hub_id)
        vla.save_pretrained(directory)
        for pipeline in (preprocessor, postprocessor):
            pipeline.save_pretrained(directory)
        written = sorted(path.name for path in Path(directory).iterdir())
        cameras = ", ".join(self.config.image_features())
        side, config, named = self.config.image_size, self.config, self.lerobot_summary(hub_id or str(self.lerobot_files()))
        return {
            f"{type(vla.config).__name__}: {named}; {OBS_STATE} ({config.obs_dim},), {cameras} (3, {side}, {side}), "
            f"{ACTION} ({config.action_dim},); chunk {config.chunk_size}, {config.num_steps} steps": [CONFIG_FILE],
            f"{type(vla).__name__} weights, {len(vla.state_dict())} tensors (the noise head and critic left out)": [WEIGHTS_FILE],
            f"preprocessor: the tokenizer; the project's state ({state_mode}) and action (MEAN_STD) normalisation": [
                name for name in written if name.startswith(preprocessor.name)
            ],
            "postprocessor: the project's action mean and std, to env units": [
                name for name in written if name.startswith(postprocessor.name)
            ],
        }

    @classmethod
    def load_with_local_path(cls, directory: str | Path, field: str, path: str | None, **overrides: Any) -> VLAFlowPolicy:
        """from_pretrained with policy.<section>.<field> (a local directory the weights do not hold: a backbone's
        config and tokenizer) replaced by `path` when given, the rest of the saved section kept."""
        if path is not None:
            saved_config = read_policy_config(directory)
            section = saved_config.vla_section()
            overrides[section] = {**dataclasses.asdict(getattr(saved_config, section)), **overrides.get(section, {}), field: path}
        return super().from_pretrained(directory, **overrides)


def hold_padded_actions(vla: nn.Module, action_dim: int) -> int:
    """Make the padded action elements of the lerobot policy `vla` (action_dim onward, up to max_action_dim) reach its
    expert no more: action_in_proj's columns for them set to zero, in place. Returns how many columns were not zero.

    The project's chain holds those elements at zero (velocity pads a_t with zeros and reads back the first
    action_dim), so these columns never touch what it computes. lerobot's sample_actions integrates all
    max_action_dim elements, from noise it draws for all of them, and feeds them back through action_in_proj: with
    the columns as trained (lerobot-train trains them on its padded noise), its first action_dim would follow another
    chain. Without them it is the project's, whatever lerobot draws for the padded elements (what it integrates there is
    sliced off its output)."""
    columns = vla.model.action_in_proj.weight[:, action_dim:]
    nonzero = int((columns != 0).any(dim=0).sum())
    with torch.no_grad():
        columns.zero_()
    return nonzero


def lerobot_sampling_copy(vla: nn.Module, action_dim: int) -> nn.Module:
    """A copy of the lerobot policy `vla` that lerobot's sampler samples as the project does (hold_padded_actions)."""
    vla = copy.deepcopy(vla)
    hold_padded_actions(vla, action_dim)
    return vla


def building_lerobot_model(config: PolicyConfig, section: str) -> contextlib.AbstractContextManager:
    """Where a backend builds its lerobot model: with policy.<section>.lerobot_checkpoint named, every tensor of it comes
    from that file (load_lerobot_checkpoint, which draws a re-initialised state projection itself), so the model is
    built without initialising its weights (initialisation_skipped); without one, it keeps its random initialisation."""
    return initialisation_skipped() if getattr(config, section).lerobot_checkpoint else contextlib.nullcontext()


def load_lerobot_checkpoint(vla: nn.Module, config: PolicyConfig, section: str, architecture_fields: tuple[str, ...]) -> None:
    """Load the lerobot checkpoint directory policy.<section>.lerobot_checkpoint (config.json + model.safetensors,
    as lerobot's save_pretrained writes it) into `vla`, strictly.

    lerobot's own loader leaves any tensor missing from the file at its random initialisation without a
    word; here every tensor of the model must come from the file, or CheckpointError lists the missing
    ones. The checkpoint's type must be policy.type, and its `architecture_fields` (names shared by lerobot's
    config and policy.<section>) must agree with policy.<section> (the error says which to set). A file that lacks
    some of the model's keys gets the renames lerobot's policy applies to older files on load (pi0's
    `_fix_pytorch_state_dict_keys`: e.g. the text embedding from a file's lm_head) before the check; the file's own
    keys win. Keys the model does not have are ignored.

    policy.<section>.reinit_state_proj: the one explicit exception. A base checkpoint's state projection is 32
    wide (its max_state_dim) and Metaworld's state has 39 elements; with the flag, `model.state_proj` is initialised
    afresh (nn.Linear's initialisation, drawn here) at policy.<section>.max_state_dim (the file's copy, of another
    width or absent, is not read) and max_state_dim may differ from the file's. Every other tensor is still required from the
    file. The robot state the checkpoint was trained on has other elements than Metaworld's, so its columns
    are not reused; behaviour cloning (learner/bc/training.py) trains the new projection.
    """
    settings = getattr(config, section)
    directory = Path(settings.lerobot_checkpoint).expanduser()
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise CheckpointError(
                f"policy.{section}.lerobot_checkpoint: {path} is missing "
                f"(a lerobot {config.type} checkpoint has config.json and model.safetensors)"
            )
    saved = json.loads(config_path.read_text())
    if saved.get("type") != config.type:
        raise CheckpointError(f"{config_path} is a lerobot {saved.get('type')!r} checkpoint, not {config.type}")
    reinit_state_proj = settings.reinit_state_proj
    mismatched = [
        f"policy.{section}.{name}={saved[name]!r} (config has {getattr(settings, name)!r})"
        for name in architecture_fields
        if name in saved and saved[name] != getattr(settings, name) and not (reinit_state_proj and name == "max_state_dim")
    ]
    if mismatched:
        state_hint = (
            f"; for a state of another width (policy.obs_dim={config.obs_dim}) keep max_state_dim and set "
            f"policy.{section}.reinit_state_proj: true to re-initialise state_proj alone"
            if any(m.startswith(f"policy.{section}.max_state_dim=") for m in mismatched)
            else ""
        )
        raise CheckpointError(f"{config_path}: architecture differs from policy.{section}; set {', '.join(mismatched)}{state_hint}")
    state = read_safetensors(weights_path)
    own = vla.state_dict()
    fresh = {k for k in own if k.startswith(STATE_PROJ_PREFIX)} if reinit_state_proj else set()  # initialised below
    expected = set(own) - fresh
    if not expected <= set(state) and hasattr(vla, "_fix_pytorch_state_dict_keys"):
        # lerobot's renames of older files, then its "model." prefix, as its from_pretrained does
        renamed = vla._fix_pytorch_state_dict_keys(state, vla.config)
        state = {**{key if key.startswith("model.") else f"model.{key}": value for key, value in renamed.items()}, **state}
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
    if fresh:
        vla.model.state_proj.reset_parameters()
