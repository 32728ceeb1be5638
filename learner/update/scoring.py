"""Scoring recorded chains: the encode and the log-probs over the iteration a micro-batch's worth of rows at a time,
the critic's values of the observations the chunks led to, and the scores of other weights (an older version's, the
KL reference's) on the same chains (`RolloutScores`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from common.flow import ChainLogProb, chain_log_prob
from common.observation import Observation
from common.policy import FlowPolicy, concat_features, index_features
from common.trajectory import RolloutBatch


def encode_in_chunks(policy: FlowPolicy, obs: Observation, rows: int, keep: Callable[[Any], Any] = lambda features: features) -> Any:
    """keep(policy.encode(...)) over `rows` observations at a time, joined. The learner never encodes more rows at once
    than one micro-batch of its update, so a VLM's activations do not grow with the iteration (the peak memory either
    way: docs/performance.md)."""
    total = obs.batch_shape[0]
    return concat_features([keep(policy.encode(obs.index(slice(start, start + rows)))) for start in range(0, total, rows)])


def next_observation_values(policy: FlowPolicy, batch: RolloutBatch, features: Any, rows: int) -> Tensor:
    """(T, N): the critic's values of the observations the chunks led to, given `features`, the encoded observations
    the chunks were chosen in (B = T * N rows). A chunk that left its episode running led to the observation its env's
    next decision read, whose features serve; only the record's bootstrap observations (episode ends, and the last
    decision's) are encoded, so a VLA's prefix pass does not run over the iteration twice."""
    num_decisions, num_envs = batch.num_decisions, batch.num_envs
    size, bootstrap = num_decisions * num_envs, batch.bootstrap_observations().to_torch(policy.obs_device)
    source = torch.arange(num_envs, num_envs + size)  # row r's next observation is row r + N's observation...
    source[torch.from_numpy(batch.bootstrap_rows())] = torch.arange(size, size + bootstrap.batch_shape[0])  # ...or a bootstrap one
    pool = concat_features([policy.critic_features(features), encode_in_chunks(policy, bootstrap, rows, policy.critic_features)])
    # The critic runs over all B rows at once, as it would over every next observation encoded: where encode() treats a
    # row alike whatever rows are beside it (the MLP's normalisation), the values are those, bit for bit.
    return policy.value(index_features(pool, source)).view(num_decisions, num_envs)


def score_in_chunks(policy: FlowPolicy, features: Any, chains: Tensor, rows: int, steps_in_one_pass: bool) -> ChainLogProb:
    """chain_log_prob over `rows` chains at a time, joined. A VLA's denoising step copies the prefix cache of every row
    it scores, so scoring a whole iteration at once would hold a second copy of the iteration's cache (docs/pi0.md)."""
    return concat_features(
        [
            chain_log_prob(
                policy,
                index_features(features, slice(start, start + rows)),
                chains[start : start + rows],
                steps_in_one_pass=steps_in_one_pass,
            )
            for start in range(0, len(chains), rows)
        ]
    )


def rescore(
    policy: FlowPolicy, obs: Observation, chains: Tensor, features: Any, rows: int, steps_in_one_pass: bool, encode_again: bool
) -> ChainLogProb:
    """`chains` scored by `policy` with other weights than the current ones (a lagged rollout's version swapped in, or
    the frozen KL reference): the observations encoded again where the learner's encoder trains, its features
    differing between weights; else the current weights' `features`, since a frozen encoder is one module in them all."""
    features = encode_in_chunks(policy, obs, rows) if encode_again else features
    return score_in_chunks(policy, features, chains, rows, steps_in_one_pass)


@dataclass
class RolloutScores:
    """A rollout's recorded chains, flattened to B = T * N decisions, as the learner scores them."""

    obs: Observation  # (B, ...) on the policy's device
    chains: Tensor  # (B, K+1, H, A)
    features: Any  # encode(obs) with the current weights
    old: ChainLogProb  # (B,) the current weights' scores: the old log-probs
    rows: int  # the most rows scored at once: the update's micro-batch
    steps_in_one_pass: bool  # as the update's passes score
    encode_again: bool  # the learner's encoder trains, so other weights encode the observations themselves
    behaviour: ChainLogProb | None = None  # (B,) the older weights' that sampled the chains; None: the current ones did

    @property
    def behaviour_log_probs(self) -> Tensor:
        """(B,) the log-probs of the weights that sampled the chains."""
        return (self.old if self.behaviour is None else self.behaviour).log_prob

    def rescore(self, policy: FlowPolicy) -> ChainLogProb:
        """The chains scored by `policy` with other weights than the current ones (rescore)."""
        return rescore(policy, self.obs, self.chains, self.features, self.rows, self.steps_in_one_pass, self.encode_again)

    def figures(self, actor_log_probs: Tensor) -> dict[str, float]:
        """The old scores' figures, and the most the actors' own behaviour log-probs (B,) differ from the learner's."""
        return {
            "logprob/old_mean": self.old.log_prob.mean().item(),
            "logprob/per_element": self.old.log_prob_per_element.mean().item(),
            # > 0: another precision or device, or a bug
            "logprob/behaviour_gap_max": (self.behaviour_log_probs - actor_log_probs).abs().max().item(),
            "policy/sigma_mean": self.old.std.mean().item(),
            "policy/entropy": self.old.entropy.mean().item(),
        }

    def behaviour_weight_figures(self) -> dict[str, float]:
        """The extremes of pi_old / pi_behaviour over the chains that older weights sampled; none for the current ones'."""
        if self.behaviour is None:
            return {}
        weight = (self.old.log_prob - self.behaviour.log_prob).exp()
        return {"ppo/behaviour_weight_min": weight.min().item(), "ppo/behaviour_weight_max": weight.max().item()}


def score_rollout(policy: FlowPolicy, obs: Observation, chains: Tensor, rows: int, steps_in_one_pass: bool) -> RolloutScores:
    """`chains` (B, K+1, H, A), chosen in `obs`, scored by the current weights `rows` at a time."""
    features = encode_in_chunks(policy, obs, rows)
    old = score_in_chunks(policy, features, chains, rows, steps_in_one_pass)
    return RolloutScores(obs, chains, features, old, rows, steps_in_one_pass, policy.encoder_is_trainable)
