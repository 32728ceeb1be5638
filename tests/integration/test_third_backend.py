"""A policy backend written here, in the test, with one registry line: behaviour cloning, rollouts, the PPO update
with the ratio exactly 1 before its first step, the checkpoint round trip and the random-init refusal all work on it
with no edit to the loop, the learner or pre-training."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from actors.rollout_actor import RolloutActor
from common.config import PolicyConfig
from common.observation import Observation
from common.policy import BACKENDS, Backend, FlowPolicy, build_policy
from learner.bc.training import REPORT_FILE, pretrain
from learner.update.learner import Learner
from tests.conftest import tiny_config

BACKEND = "projected_flow"


class ProjectedStateFlowPolicy(FlowPolicy):
    """A state policy unlike the MLP: a trainable linear encoder of the normalised state (so the learner encodes
    again for every micro-batch), a velocity net, a noise head bounded by a sigmoid, and a linear critic."""

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        width, elements = config.hidden_dim, config.action_elements
        self.encoder = nn.Linear(config.obs_dim, width)
        self.velocity_net = nn.Sequential(nn.Linear(width + elements + 1, width), nn.Tanh(), nn.Linear(width, elements))
        self.noise_net = nn.Linear(width + 1, elements)
        self.critic_net = nn.Linear(width, 1)
        self.register_normalization()

    def encode(self, obs: Observation) -> Tensor:
        return torch.tanh(self.encoder(self.normalized_state(obs)))

    @property
    def encoder_is_trainable(self) -> bool:
        return True

    def behaviour_cloning_parameters(self) -> list[nn.Parameter]:
        return [*self.encoder.parameters(), *self.velocity_net.parameters()]

    def tokenize(self, instructions: list[str]) -> None:
        return None

    def velocity(self, action: Tensor, t: Tensor, features: Tensor) -> Tensor:
        return self.velocity_net(torch.cat([features, action.flatten(1), t[:, None]], dim=-1)).view_as(action)

    def velocity_and_sigma(self, action: Tensor, t: Tensor, features: Tensor) -> tuple[Tensor, Tensor]:
        raw = self.noise_net(torch.cat([features, t[:, None]], dim=-1))
        sigma = self.config.sigma_min + (self.config.sigma_max - self.config.sigma_min) * torch.sigmoid(raw)
        return self.velocity(action, t, features), sigma.view(-1, self.chunk_size, self.action_dim)

    def value(self, features: Tensor) -> Tensor:
        return self.critic_net(features).squeeze(-1)

    def critic_parameter_names(self) -> list[str]:
        return [f"critic_net.{name}" for name, _ in self.critic_net.named_parameters()]


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(BACKENDS, BACKEND, Backend(f"{__name__}:ProjectedStateFlowPolicy"))


def test_a_backend_added_in_one_registry_line_runs_bc_rollouts_and_the_update(registered, tmp_path) -> None:
    config = tiny_config(tmp_path, **{"policy.type": BACKEND, "policy.hidden_dim": 32, "pretrain.train_steps": 300})
    checkpoint = tmp_path / "bc"
    pretrain(config, checkpoint, progress=False)
    report = json.loads((checkpoint / REPORT_FILE).read_text())
    assert np.isfinite(report["loss_last_100"]) and report["loss_last_100"] < report["loss_first_100"]
    torch.manual_seed(config.pretrain.seed)
    untrained, trained = build_policy(config.policy), FlowPolicy.from_pretrained(checkpoint)
    assert type(trained) is ProjectedStateFlowPolicy
    assert not torch.equal(trained.encoder.weight, untrained.encoder.weight)  # BC trains what the backend names
    assert torch.equal(trained.critic_net.weight, untrained.critic_net.weight)  # and nothing else

    with pytest.raises(Exception, match="random"):  # a randomly initialised backend is refused unless asked for
        Learner(config, build_policy(config.policy))
    actor, learner = RolloutActor(config, 0, checkpoint), Learner(config, FlowPolicy.from_pretrained(checkpoint))
    actor.load_weights(learner.broadcast())
    batch = actor.sample(None, iteration=0)
    before = {name: tensor.clone() for name, tensor in learner.policy.state_dict().items()}
    metrics = learner.update(batch)
    assert metrics["ppo/first_minibatch_ratio_dev"] <= 1e-5 and metrics["logprob/behaviour_gap_max"] < 1e-4
    changed = {name.split(".")[0] for name, tensor in learner.policy.state_dict().items() if not torch.equal(tensor, before[name])}
    assert {"encoder", "velocity_net", "critic_net"} <= changed and not changed & {"obs_mean", "obs_std"}
    actor.load_weights(learner.broadcast())
    assert torch.equal(actor.policy.encoder.weight, learner.policy.encoder.weight)
    again = FlowPolicy.from_pretrained(learner.policy.save_pretrained(tmp_path / "after"))
    assert all(torch.equal(tensor, learner.policy.state_dict()[name]) for name, tensor in again.state_dict().items())
