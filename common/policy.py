"""The policy interface every backend implements, and the small state-based flow policy.

A backend provides four pieces, all on explicit tensors:
  encode(obs)              -> features, computed once per decision and reused by every call below
                              (the MLP's normalised state; SmolVLA's prefix KV cache later)
  velocity(a_t, t, feats)  -> (B, H, A) flow velocity
  sigma(t, feats)          -> (B, H, A) injected-noise std, bounded to [sigma_min, sigma_max]
  value(feats)             -> (B,) critic value
The chain math (time grid, sampling, log-probs) lives in common.flow and is shared by every backend.

Actions inside the chain are normalised (zero mean, unit std per action element over the
demonstrations); `to_env_action` maps a chunk back to the environment's units.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from common.config import ConfigError, PolicyConfig, from_dict

WEIGHTS_FILE = "model.safetensors"
OBS_STD_FLOOR = 0.05  # in env units (metres for positions, unit quaternion components)
OBS_CLIP = 5.0  # normalised features are clipped to +-OBS_CLIP
CONFIG_FILE = "config.json"


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, malformed, or does not match the model it is loaded into."""


class FlowPolicy(nn.Module, ABC):
    """Base class of every flow-matching policy backend (see the module docstring for the contract)."""

    config: PolicyConfig
    # Where the weights came from: set by from_pretrained, None for a fresh random initialisation.
    # The learner refuses to fine-tune a policy whose loaded_from is None unless told otherwise.
    loaded_from: str | None = None

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
    def obs_device(self) -> torch.device:
        """Where observations must be placed for encode()."""
        return next(self.parameters()).device

    @abstractmethod
    def encode(self, obs: Tensor) -> Any:
        """obs (B, obs_dim) -> features consumed by velocity/sigma/value."""

    @abstractmethod
    def velocity(self, action: Tensor, t: Tensor, features: Any) -> Tensor:
        """action (B, H, A), t (B,) in [0, 1) -> velocity (B, H, A)."""

    @abstractmethod
    def sigma(self, t: Tensor, features: Any) -> Tensor:
        """t (B,) -> injected-noise std (B, H, A) in [sigma_min, sigma_max]."""

    @abstractmethod
    def value(self, features: Any) -> Tensor:
        """features -> critic value (B,)."""

    @abstractmethod
    def to_env_action(self, chunk: Tensor) -> Tensor:
        """Normalised chunk (B, H, A) -> environment actions (B, H, A), clipped to the action bounds."""

    @abstractmethod
    def critic_parameter_names(self) -> list[str]:
        """Names of the critic's parameters (optimised with the critic's learning rate)."""

    def broadcast_state(self) -> dict[str, Tensor]:
        """The tensors rollout actors need after an update: the trainable parameters only."""
        return {name: p.detach() for name, p in self.named_parameters() if p.requires_grad}

    # -- persistence (lerobot-style: a directory with safetensors weights and a type-tagged config) --

    def save_pretrained(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_FILE))
        (directory / CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(self.config), indent=2, sort_keys=True))
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | Path, **overrides: Any) -> FlowPolicy:
        """Load a policy saved by save_pretrained from a local directory (never from a hub)."""
        directory = Path(directory)
        config = read_policy_config(directory, **overrides)
        policy_cls = POLICY_TYPES[config.type] if cls is FlowPolicy else cls
        policy = policy_cls(config)
        weights_path = directory / WEIGHTS_FILE
        if not weights_path.is_file():
            raise CheckpointError(f"{weights_path} is missing: not a policy checkpoint directory")
        try:
            state = load_file(str(weights_path))
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise CheckpointError(f"{weights_path} could not be read as safetensors: {exc}") from exc
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


def write_directory_atomically(directory: str | Path, write: Callable[[Path], None]) -> Path:
    """Call write(tmp) on a fresh sibling temp directory, then swap it into place with renames only,
    so a crash at any point leaves either the old directory or the new one, never half of either."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    old = directory.with_name(f".{directory.name}.old-{os.getpid()}")
    for leftover in (tmp, old):
        shutil.rmtree(leftover, ignore_errors=True)
    tmp.mkdir()
    write(tmp)
    if directory.exists():
        directory.rename(old)
    tmp.rename(directory)
    shutil.rmtree(old, ignore_errors=True)
    return directory


def read_policy_config(directory: str | Path, **overrides: Any) -> PolicyConfig:
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
    if config.type not in POLICY_TYPES:
        raise CheckpointError(f"{path}: unknown policy type {config.type!r}; known: {sorted(POLICY_TYPES)}")
    return config


def time_embedding(t: Tensor, dim: int) -> Tensor:
    """Sinusoidal embedding of flow time t (B,) in [0, 1] -> (B, dim)."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, dtype=t.dtype, device=t.device) * (-math.log(1000.0) / max(half - 1, 1)))
    angles = t[:, None] * 1000.0 * freqs[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


def mlp(in_dim: int, hidden: int, out_dim: int, layers: int, dropout: float = 0.0) -> nn.Sequential:
    modules: list[nn.Module] = []
    width = in_dim
    for _ in range(layers):
        # Dropout is always present (p = 0 is a no-op) so checkpoints load whatever p a run asks for.
        modules += [nn.Linear(width, hidden), nn.Mish(), nn.Dropout(dropout)]
        width = hidden
    modules.append(nn.Linear(width, out_dim))
    return nn.Sequential(*modules)


class MLPFlowPolicy(FlowPolicy):
    """State-based flow policy: MLP velocity field, ReinFlow noise head and critic on the normalised state."""

    def __init__(self, config: PolicyConfig):
        super().__init__()
        config.validate()
        self.config = config
        d = config.action_elements
        self.velocity_net = mlp(config.obs_dim + d + config.time_embed_dim, config.hidden_dim, d, config.num_layers, config.dropout)
        # The noise head sees time and state, not the noisy action (as in ReinFlow).
        self.noise_net = mlp(config.obs_dim + config.time_embed_dim, config.hidden_dim // 2, d, 2)
        self.critic_net = mlp(config.obs_dim, config.hidden_dim, 1, 2)
        self.register_buffer("obs_mean", torch.zeros(config.obs_dim))
        self.register_buffer("obs_std", torch.ones(config.obs_dim))
        self.register_buffer("action_mean", torch.zeros(config.action_dim))
        self.register_buffer("action_std", torch.ones(config.action_dim))
        self.log_var_min = 2.0 * math.log(config.sigma_min)
        self.log_var_max = 2.0 * math.log(config.sigma_max)

    def set_normalization(self, obs_mean: Tensor, obs_std: Tensor, action_mean: Tensor, action_std: Tensor) -> None:
        """Store normalisation statistics (saved with the weights).

        Observation stds are floored at OBS_STD_FLOOR: a few demonstrations barely move some state
        elements (the block's orientation quaternion varies by ~0.003), and dividing by that turned a
        block knocked over during RL into features of ~650, gradient norms 10x the usual, and a run whose
        held-out success fell from 0.43 to 0.26 (seed 2 before this fix)."""
        self.obs_mean.copy_(obs_mean)
        self.obs_std.copy_(obs_std.clamp_min(OBS_STD_FLOOR))
        self.action_mean.copy_(action_mean)
        self.action_std.copy_(action_std.clamp_min(1e-3))

    def normalize_action(self, action: Tensor) -> Tensor:
        return (action - self.action_mean) / self.action_std

    def to_env_action(self, chunk: Tensor) -> Tensor:
        return (chunk * self.action_std + self.action_mean).clamp(-1.0, 1.0)

    def encode(self, obs: Tensor) -> Tensor:
        # Clipped like gymnasium's NormalizeObservation users do: states unseen in the demonstrations
        # saturate instead of dominating every layer.
        return ((obs - self.obs_mean) / self.obs_std).clamp(-OBS_CLIP, OBS_CLIP)

    def velocity(self, action: Tensor, t: Tensor, features: Tensor) -> Tensor:
        temb = time_embedding(t, self.config.time_embed_dim)
        x = torch.cat([features, action.flatten(1), temb], dim=-1)
        return self.velocity_net(x).view_as(action)

    def sigma(self, t: Tensor, features: Tensor) -> Tensor:
        temb = time_embedding(t, self.config.time_embed_dim)
        raw = self.noise_net(torch.cat([features, temb], dim=-1))
        log_var = self.log_var_min + 0.5 * (torch.tanh(raw) + 1.0) * (self.log_var_max - self.log_var_min)
        return torch.exp(0.5 * log_var).view(-1, self.chunk_size, self.action_dim)

    def value(self, features: Tensor) -> Tensor:
        return self.critic_net(features).squeeze(-1)

    def critic_parameter_names(self) -> list[str]:
        return [f"critic_net.{name}" for name, _ in self.critic_net.named_parameters()]


POLICY_TYPES: dict[str, type[FlowPolicy]] = {"mlp_flow": MLPFlowPolicy}


def build_policy(config: PolicyConfig) -> FlowPolicy:
    if config.type not in POLICY_TYPES:
        raise ConfigError(f"policy.type must be one of {sorted(POLICY_TYPES)}, got {config.type!r}")
    return POLICY_TYPES[config.type](config)
