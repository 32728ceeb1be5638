"""The small state-based flow policy: MLP velocity field, ReinFlow noise head and critic on the normalised state."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from common.config import PolicyConfig
from common.observation import Observation
from common.policy.base import FlowPolicy


def time_embedding(t: Tensor, dim: int) -> Tensor:
    """Sinusoidal embedding of flow time t (B,) in [0, 1] -> (B, dim)."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, dtype=t.dtype, device=t.device) * (-math.log(1000.0) / max(half - 1, 1)))
    angles = t[:, None] * 1000.0 * freqs[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class MLP(nn.Sequential):
    """Linear, Mish and slot layers in sequence, whose forward calls the layers' functional ops directly.

    An actor's decision for a few envs is dispatch-bound, and nn.Module's call machinery (hook and tracing checks, one
    forward per layer) is a sizeable part of it (docs/performance.md). The same ATen ops run on the same tensors, so
    the output is nn.Sequential's bit for bit, under autograd and autocast alike; forward hooks registered on the layers
    themselves do not run. Any other layer in a slot (dropout, in tests) is called as a module, so it keeps its train/eval
    behaviour."""

    def forward(self, x: Tensor) -> Tensor:
        for layer in self:
            if type(layer) is nn.Linear:
                x = F.linear(x, layer.weight, layer.bias)
            elif type(layer) is nn.Mish:
                x = F.mish(x)
            elif type(layer) is not nn.Identity:
                x = layer(x)
        return x


def mlp(in_dim: int, hidden: int, out_dim: int, layers: int) -> MLP:
    modules: list[nn.Module] = []
    width = in_dim
    for _ in range(layers):
        # Each hidden layer ends in a parameter-free slot (an Identity, which MLP.forward skips): checkpoints name their
        # tensors by these indices, and the tests put dropout there to provoke the train-mode failure.
        modules += [nn.Linear(width, hidden), nn.Mish(), nn.Identity()]
        width = hidden
    modules.append(nn.Linear(width, out_dim))
    return MLP(*modules)


class MLPFlowPolicy(FlowPolicy):
    """State-based flow policy: MLP velocity field, ReinFlow noise head and critic on the normalised state."""

    def __init__(self, config: PolicyConfig):
        super().__init__()
        config.validate()
        self.config = config
        d = config.action_elements
        self.velocity_net = mlp(config.obs_dim + d + config.time_embed_dim, config.hidden_dim, d, config.num_layers)
        # The noise head sees time and state, not the noisy action (as in ReinFlow).
        self.noise_net = mlp(config.obs_dim + config.time_embed_dim, config.hidden_dim // 2, d, 2)
        self.critic_net = mlp(config.obs_dim, config.hidden_dim, 1, 2)
        self.register_normalization()
        self.log_var_min = 2.0 * math.log(config.sigma_min)
        self.log_var_max = 2.0 * math.log(config.sigma_max)
        self._time_embeddings: dict[int, tuple[Tensor, int, Tensor]] = {}  # embed_time's memo: id(t) -> (t, version, embedding)

    def encode(self, obs: Observation) -> Tensor:
        """The normalised, clipped state (B, obs_dim); frames and instruction, if any, are not read."""
        return self.normalized_state(obs)

    @property
    def encoder_is_trainable(self) -> bool:
        return False  # encode() reads buffers only (the normalisation statistics)

    def behaviour_cloning_parameters(self) -> list[nn.Parameter]:
        return list(self.velocity_net.parameters())

    def tokenize(self, instructions: list[str]) -> None:
        return None  # a state policy reads no language

    def embed_time(self, t: Tensor) -> Tensor:
        """time_embedding(t), computed once per t tensor. common.flow.step_time hands every decision the same tensor
        for step k, so an actor embeds each step time once instead of twice per step of every decision (a sixth of a
        decision's CPU for 2 envs), with the same ops on the same shape, hence the same bits. The memo holds t, so its
        id cannot be reused by another tensor, and t's version counter, so a t written in place is embedded again."""
        # Differentiated through: a held embedding would carry another call's graph, or none. Compiled: the graph
        # computes it inside, and the memo's host-side lookup (ids, version counters) has no place in a trace.
        if t.requires_grad or torch.compiler.is_compiling():
            return time_embedding(t, self.config.time_embed_dim)
        held = self._time_embeddings.get(id(t))
        if held is not None and held[0] is t and held[1] == t._version:
            return held[2]
        embedding = time_embedding(t, self.config.time_embed_dim)
        if len(self._time_embeddings) >= 64:  # K steps per batch size in use; callers passing fresh tensors churn it
            self._time_embeddings.clear()
        self._time_embeddings[id(t)] = (t, t._version, embedding)
        return embedding

    def velocity(self, action: Tensor, t: Tensor, features: Tensor) -> Tensor:
        x = torch.cat([features, action.flatten(1), self.embed_time(t)], dim=-1)
        return self.velocity_net(x).view_as(action)

    def velocity_and_sigma(self, action: Tensor, t: Tensor, features: Tensor) -> tuple[Tensor, Tensor]:
        return self.velocity(action, t, features), self.sigma(t, features)

    def sigma(self, t: Tensor, features: Tensor) -> Tensor:
        """The injected-noise std (B, H, A): the noise head reads the state and the time, not the action."""
        raw = self.noise_net(torch.cat([features, self.embed_time(t)], dim=-1))
        log_var = self.log_var_min + 0.5 * (torch.tanh(raw) + 1.0) * (self.log_var_max - self.log_var_min)
        return torch.exp(0.5 * log_var).view(-1, self.chunk_size, self.action_dim)

    def value(self, features: Tensor) -> Tensor:
        return self.critic_net(features).squeeze(-1)

    def critic_parameter_names(self) -> list[str]:
        return [f"critic_net.{name}" for name, _ in self.critic_net.named_parameters()]
