"""The policy interface every backend implements, its checkpoint I/O (on common.storage), and the backend lookup.

A backend provides these pieces, all on explicit tensors:
  encode(obs: Observation) -> features, computed once per decision and reused by every call below
                              (the MLP's normalised state; SmolVLA's prefix KV cache). Features are a
                              Tensor, or a dataclass / tuple / list / dict of them, batch first;
                              `index_features` slices any such structure, `concat_features` joins them.
  velocity(a_t, t, feats)  -> (B, H, A) flow velocity (behaviour cloning's target)
  velocity_and_sigma(a_t, t, feats)
                           -> the velocity and the injected-noise std (B, H, A), bounded to [sigma_min, sigma_max],
                              of one denoising step, in one call
  value(feats)             -> (B,) critic value; critic_features(feats) keeps only what value() reads
  encoder_is_trainable     -> whether a trainable parameter feeds encode(). When it does not, the learner
                              encodes each rollout once per iteration and reuses the features in every
                              PPO epoch and minibatch; when it does, it re-encodes every micro-batch.
  tokenize(instructions)   -> (token ids (B, L) int64, mask (B, L) bool), or None without language.
                              Called once per env (an env's instruction never changes).
The chain math (time grid, sampling, log-probs) lives in common.flow and is shared by every backend.

Actions inside the chain are normalised (zero mean, unit std per action element over the
demonstrations); `to_env_action` maps a chunk back to the environment's units.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from common.config import ConfigError, PolicyConfig
from common.config_loading import from_dict
from common.observation import Observation
from common.policy.initialisation import initialisation_skipped
from common.policy.registry import BACKENDS
from common.storage import (
    CheckpointError,
    read_safetensors,
    verify_checksums,
)

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
OBS_STD_FLOOR = 0.05  # in env units (metres for positions, unit quaternion components)
OBS_CLIP = 5.0  # normalised state features are clipped to +-OBS_CLIP


class FlowPolicy(nn.Module, ABC):
    """Base class of every flow-matching policy backend (see the module docstring for the contract)."""

    config: PolicyConfig
    # Where the weights came from: set by from_pretrained, None for a fresh random initialisation.
    # The learner refuses to fine-tune a policy whose loaded_from is None unless told otherwise.
    loaded_from: str | None = None
    # A common.decision_graph.DecisionGraph that replays whole chunk decisions on a GPU (set by the rollout actor with
    # actors.speed.cuda_graphs); None: common.rollout.decide runs the policy eagerly.
    decision_graph: Any = None
    # gaussian_step compiled for this policy, (features, action, t, dt) -> (mean, std) (common.flow.compile_steps, set
    # by the rollout actor with actors.speed.compile_steps); None: common.flow.transition runs the step eagerly.
    compiled_step: Any = None

    @property
    def chunk_size(self) -> int:
        return self.config.chunk_size

    @property
    def action_dim(self) -> int:
        return self.config.action_dim

    @property
    def num_steps(self) -> int:
        return self.config.num_steps

    @property
    def lerobot_type(self) -> str | None:
        """The lerobot policy type to_lerobot writes this policy as, or None where it has no lerobot counterpart."""
        return BACKENDS[self.config.type].lerobot_type

    @property
    def obs_device(self) -> torch.device:
        """Where observations must be placed for encode()."""
        return next(self.parameters()).device

    @property
    def precision(self) -> str:
        """The arithmetic this policy runs in right now, e.g. 'float32 on cpu', or 'bfloat16 autocast over
        float32 weights on cuda:0' inside torch.autocast (actors and learner may differ)."""
        device = self.obs_device
        weights = "+".join(sorted({str(p.dtype).removeprefix("torch.") for p in self.parameters()}))
        if torch.is_autocast_enabled(device.type):
            return f"{str(torch.get_autocast_dtype(device.type)).removeprefix('torch.')} autocast over {weights} weights on {device}"
        return f"{weights} on {device}"

    @abstractmethod
    def encode(self, obs: Observation) -> Any:
        """Observation (torch, on obs_device, batch B) -> features consumed by velocity/sigma/value."""

    @property
    @abstractmethod
    def encoder_is_trainable(self) -> bool:
        """True only when a trainable parameter (requires_grad) feeds encode()."""

    def behaviour_cloning_parameters(self) -> list[nn.Parameter]:
        """What behaviour cloning (learner.bc.training) trains. By default every parameter, made trainable: the
        flow-matching loss reaches only what feeds the velocity, so the noise head and critic keep their
        initial values (the optimiser skips parameters without a gradient). A backend overrides this to train
        less; RL chooses its own trainable set when it loads the checkpoint."""
        self.requires_grad_(True)
        return list(self.parameters())

    def capture_context(self) -> contextlib.AbstractContextManager:
        """Entered while a CUDA graph of the policy's decisions is warmed up and captured (common.decision_graph): a
        backend whose library reads device tensors on the host on the way swaps in an equivalent path here."""
        return contextlib.nullcontext()

    def graph_observation(self, obs: Observation) -> Observation:
        """The numpy observation a CUDA graph of the policy's decisions reads, from the one a decision gets: host work
        that a capture cannot hold (pi0.5 writes the state into its prompt) is done here, before each replay, and
        capture_context() then reads its result. The same observation for a backend with no such work."""
        return obs

    @abstractmethod
    def tokenize(self, instructions: list[str]) -> tuple[np.ndarray, np.ndarray] | None:
        """Instructions -> (token ids (B, L) int64, mask (B, L) bool, True on real tokens), or None for a
        backend that reads no language."""

    @abstractmethod
    def velocity(self, action: Tensor, t: Tensor, features: Any) -> Tensor:
        """action (B, H, A), t (B,) in [0, 1) -> velocity (B, H, A)."""

    @abstractmethod
    def velocity_and_sigma(self, action: Tensor, t: Tensor, features: Any) -> tuple[Tensor, Tensor]:
        """action (B, H, A), t (B,) in [0, 1) -> the velocity and the injected-noise std (B, H, A) in [sigma_min, sigma_max]
        of the Gaussian step from `action` (common.flow.gaussian_step). One call, so that a noise head reading the velocity
        pass's hidden state (the VLAs') gets it from that pass."""

    @abstractmethod
    def value(self, features: Any) -> Tensor:
        """features -> critic value (B,)."""

    def recorded_image_embeddings(self, features: Any) -> Tensor | None:
        """(B, C, T, D) what a rollout records in place of the frames a decision read: a VLA's vision-tower tokens of
        them, kept by encode() (actors.speed.send_image_embeddings); None: the record keeps the frames."""
        return None

    def critic_features(self, features: Any) -> Any:
        """encode()'s output cut down to what value() reads, for the learner to keep many rows of cheaply. All of it
        by default; a VLA drops its prefix cache."""
        return features

    # -- normalisation: state and action statistics of the demonstrations, buffers saved with the weights --------

    def register_normalization(self) -> None:
        """The normalisation buffers, identity until set_normalization (every backend calls this in __init__)."""
        self.register_buffer("obs_mean", torch.zeros(self.config.obs_dim))
        self.register_buffer("obs_std", torch.ones(self.config.obs_dim))
        self.register_buffer("action_mean", torch.zeros(self.config.action_dim))
        self.register_buffer("action_std", torch.ones(self.config.action_dim))

    def set_normalization(self, obs_mean: Tensor, obs_std: Tensor, action_mean: Tensor, action_std: Tensor, exact: bool = False) -> None:
        """Store normalisation statistics (saved with the weights).

        Observation stds are floored at OBS_STD_FLOOR: a few demonstrations barely move some state elements (a
        block's orientation quaternion), and dividing by so small a spread turns a block knocked over during RL into
        features in the hundreds that swamp every layer and gradient. exact: the statistics as given, unfloored (a
        lerobot checkpoint's normaliser, whose model read states normalised by them alone)."""
        self.obs_mean.copy_(obs_mean)
        self.obs_std.copy_(obs_std if exact else obs_std.clamp_min(OBS_STD_FLOOR))
        self.action_mean.copy_(action_mean)
        self.action_std.copy_(action_std if exact else action_std.clamp_min(1e-3))

    def set_state_bounds(self, low: Tensor, high: Tensor) -> None:
        """Normalise the state to [-1, 1] over its bounds (obs_dim,): what a policy that no demonstration has set
        statistics for reads, so that states in hundreds of units (pixels) do not all saturate at the clip."""
        self.set_normalization((low + high) / 2, (high - low) / 2, self.action_mean, self.action_std)

    def normalized_state(self, obs: Observation) -> Tensor:
        """(B, obs_dim), clipped like gymnasium's NormalizeObservation users do: states unseen in the
        demonstrations saturate instead of dominating every layer."""
        return ((obs.state - self.obs_mean) / self.obs_std).clamp(-OBS_CLIP, OBS_CLIP)

    def share_beyond_clip(self, state: Tensor) -> float:
        """The share of the states (..., obs_dim), env units, with an element that normalized_state clips (beyond
        +-OBS_CLIP std of the mean): where the policy reads another state than lerobot's normaliser gives an export."""
        beyond = ((state.to(self.obs_mean.device) - self.obs_mean) / self.obs_std).abs() > OBS_CLIP
        return float(beyond.any(dim=-1).float().mean()) if beyond.numel() else 0.0

    def normalize_action(self, action: Tensor) -> Tensor:
        return (action - self.action_mean) / self.action_std

    def to_env_action(self, chunk: Tensor) -> Tensor:
        """Normalised chunk (B, H, A) -> environment actions (B, H, A), clipped to the action bounds."""
        return (chunk * self.action_std + self.action_mean).clamp(-1.0, 1.0)

    @abstractmethod
    def critic_parameter_names(self) -> list[str]:
        """Names of the critic's parameters (optimised with the critic's learning rate)."""

    def set_backbone_dtype(self, dtype: torch.dtype) -> FlowPolicy:
        """Store a large backbone's weights in `dtype` for a reduced-precision actor (actors.speed.precision);
        a backend without one (the MLP) keeps its weights as they are."""
        return self

    def broadcast_state(self) -> dict[str, Tensor]:
        """The tensors rollout actors need after an update: the trainable parameters only."""
        return {name: p.detach() for name, p in self.named_parameters() if p.requires_grad}

    # -- persistence (lerobot-style: a directory with safetensors weights and a type-tagged config) --

    def to_lerobot(self, directory: Path) -> dict[str, list[str]]:
        """Write this policy into the empty `directory` as a checkpoint of lerobot's `lerobot_type` policy, everything
        lerobot's own loaders read (the policy class's from_pretrained, make_pre_post_processors), the project's
        normalisation included -> {what a group of files holds: their names}. A backend with a lerobot counterpart
        overrides this and names its type in common.policy.registry.BACKENDS."""
        raise CheckpointError(f"policy.type {self.config.type!r} has no lerobot counterpart: there is nothing to export to lerobot")

    def save_pretrained(self, directory: str | Path, state: dict[str, Tensor] | None = None) -> Path:
        """`state`: the tensors to write in place of this policy's state_dict (a sharded learner's, gathered whole)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in (self.state_dict() if state is None else state).items()}
        save_file(state, str(directory / WEIGHTS_FILE))
        (directory / CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(self.config), indent=2, sort_keys=True))
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | Path, **overrides: Any) -> FlowPolicy:
        """Load a policy saved by save_pretrained from a local directory (never from a hub). The model is built
        without initialising its weights (initialisation_skipped): the file holds every tensor."""
        directory = Path(directory)
        config = read_policy_config(directory, **overrides)
        policy_cls = policy_class(config.type) if cls is FlowPolicy else cls
        with initialisation_skipped():
            policy = policy_cls(config)
        weights_path = directory / WEIGHTS_FILE
        if not weights_path.is_file():
            raise CheckpointError(f"{weights_path} is missing: not a policy checkpoint directory")
        state = read_safetensors(weights_path)
        own = policy.state_dict()
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        wrong_shape = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
        if missing or unexpected or wrong_shape:
            raise CheckpointError(
                f"{weights_path} does not match {policy_cls.__name__}({config.type}): "
                f"missing={missing[:5]} unexpected={unexpected[:5]} wrong_shape={wrong_shape[:5]}"
            )
        policy.load_state_dict(state)
        policy.loaded_from = str(directory.resolve())
        return policy.eval()


def index_features(features: Any, idx: Tensor | slice) -> Any:
    """Rows `idx` of encode()'s output, whatever its structure: a Tensor, or a dataclass / tuple / list /
    dict nesting tensors whose leading dim is the batch. Other leaves (None, numbers, strings) are shared
    by the whole batch and returned as they are."""
    if isinstance(features, Tensor):
        return features[idx.to(features.device) if isinstance(idx, Tensor) else idx]
    if dataclasses.is_dataclass(features) and not isinstance(features, type):
        return dataclasses.replace(
            features, **{f.name: index_features(getattr(features, f.name), idx) for f in dataclasses.fields(features) if f.init}
        )
    if isinstance(features, dict):
        return type(features)((key, index_features(value, idx)) for key, value in features.items())
    if isinstance(features, (tuple, list)):
        items = [index_features(value, idx) for value in features]
        return type(features)(*items) if hasattr(features, "_fields") else type(features)(items)
    return features


def concat_features(parts: list[Any]) -> Any:
    """The inverse of index_features over consecutive rows: join encode() outputs of the same structure along the
    batch. Leaves that are not tensors are shared by the whole batch and taken from the first part."""
    first = parts[0]
    if isinstance(first, Tensor):
        return torch.cat(parts)
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        return dataclasses.replace(
            first, **{f.name: concat_features([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(first) if f.init}
        )
    if isinstance(first, dict):
        return type(first)((key, concat_features([p[key] for p in parts])) for key in first)
    if isinstance(first, (tuple, list)):
        items = [concat_features([p[i] for p in parts]) for i in range(len(first))]
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)
    return first


def read_policy_config(directory: str | Path, **overrides: Any) -> PolicyConfig:
    """The policy config of a checkpoint directory, after verifying the directory's checksums."""
    verify_checksums(directory)
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: not a policy checkpoint directory")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    data.update(overrides)
    try:
        config = from_dict(PolicyConfig, data, "policy")
        config.validate()
    except ConfigError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    if config.type not in BACKENDS:
        raise CheckpointError(f"{path}: unknown policy type {config.type!r}; known: {sorted(BACKENDS)}")
    return config


def policy_class(type_name: str) -> type[FlowPolicy]:
    if type_name not in BACKENDS:
        raise ConfigError(f"policy.type must be one of {sorted(BACKENDS)}, got {type_name!r}")
    module_name, class_name = BACKENDS[type_name].policy_class.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def build_policy(config: PolicyConfig) -> FlowPolicy:
    """A freshly initialised policy of the configured backend (random weights: see FlowPolicy.loaded_from)."""
    return policy_class(config.type)(config)
