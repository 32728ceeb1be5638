"""The algorithms: each one's advantages over a rollout (PPO's GAE on the critic's values, GRPO's group-relative episode
returns), which decisions enter its loss, and the loss of a minibatch, as pure functions of what the learner prepared."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from common.config import AlgorithmConfig
from common.diagnostics import NonFiniteError
from common.flow import ChainLogProb, num_log_prob_elements
from common.policy import FlowPolicy, index_features
from common.rl import gae, grpo_advantages, kl_to_reference, ppo_policy_loss, value_loss
from common.trajectory import RolloutBatch
from learner.group.ranks import SingleRank
from learner.update.batch import PreparedBatch
from learner.update.scoring import next_observation_values


@dataclass
class Advantages:
    """An algorithm's advantage step over the flattened rollout: B = T * N decisions."""

    advantages: Tensor  # (B,)
    values: Tensor | None  # (B,) the critic's values of the states; None without a critic
    returns: Tensor | None  # (B,) the critic's targets; None without a critic
    keep: Tensor | None  # (B,) bool: the decisions the algorithm lets into the loss; None: all of them
    metrics: dict[str, float]
    # (B,) bool: the decisions whose advantages are normalised together (over every rank's); None: not normalised
    normalize_over: Tensor | None = None


class PPO:
    """GAE on the critic's values; the critic trains beside the actor, and alone for algorithm.critic_warmup_iters."""

    critic = True
    counts: tuple[str, ...] = ()  # metrics that count (a learner group sums them over its ranks)

    def __init__(self, cfg: AlgorithmConfig):
        self.cfg = cfg

    def trains_actor(self, iteration: int) -> bool:
        return iteration >= self.cfg.critic_warmup_iters

    def advantages(
        self, policy: FlowPolicy, batch: RolloutBatch, t: dict[str, Tensor], features: Any, rows: int, ranks: SingleRank
    ) -> Advantages:
        cfg = self.cfg
        num_decisions, num_envs = batch.num_decisions, batch.num_envs
        b_values = policy.value(features)
        next_values = next_observation_values(policy, batch, features, rows)
        values = b_values.view(num_decisions, num_envs)
        advantages, returns = gae(t["rewards"], values, next_values, t["discounts"], t["terminated"], t["truncated"], cfg.gae_lambda)
        b_advantages, b_returns = advantages.flatten(), returns.flatten()
        # over the decisions that enter the loss
        normalize_over = t["valid"].flatten().to(b_advantages.device) if cfg.normalize_advantages else None
        metrics = {
            "values/mean": b_values.mean().item(),
            "values/advantage_raw_std": ranks.std(advantages),  # over every rank's decisions
            "values/returns_mean": returns.mean().item(),
        }
        return Advantages(b_advantages, b_values, b_returns, None, metrics, normalize_over)

    def require_decisions(self, advantages: Advantages, ranks: SingleRank) -> None:
        pass


def decision_tasks(batch: RolloutBatch, tasks: list[str]) -> Tensor:
    """(B,) the index in `tasks` of the task each decision of the flattened rollout was sampled in (RolloutBatch.env_tasks)."""
    if not batch.env_tasks:
        raise ValueError("a multi-task update needs the rollout's env_tasks (common.rollout.collect_rollout)")
    return torch.from_numpy(np.tile(np.array([tasks.index(task) for task in batch.env_tasks]), batch.num_decisions))


def task_groups(batch: RolloutBatch, over: Tensor, tasks: list[str]) -> dict[str, Tensor]:
    """The decisions of `over` (B,) of each of `tasks`: every task in the run's order, one this rank has none of
    included, so the ranks' statistics meet task by task."""
    per_decision = decision_tasks(batch, tasks).to(over.device)
    return {task: over & (per_decision == index) for index, task in enumerate(tasks)}


class GRPO:
    """Group-relative episode advantages (common.rl.grpo_advantages). No critic: it is neither trained, broadcast nor
    warmed up. Only the decisions of groups whose episodes all completed, none broken by its env, enter the loss."""

    critic = False
    counts = ("grpo/groups", "grpo/groups_all_equal", "grpo/groups_broken", "grpo/groups_incomplete", "grpo/episodes_cut_off")

    def __init__(self, cfg: AlgorithmConfig):
        self.cfg = cfg

    def trains_actor(self, iteration: int) -> bool:
        return True

    def advantages(
        self, policy: FlowPolicy, batch: RolloutBatch, t: dict[str, Tensor], features: Any, rows: int, ranks: SingleRank
    ) -> Advantages:
        cfg, states = self.cfg, torch.from_numpy(np.array(batch.obs.state)).to(t["rewards"].device)
        advantages, keep, grpo_metrics = grpo_advantages(
            t["rewards"],
            t["discounts"],
            t["terminated"],
            t["truncated"],
            t["valid"],
            cfg.group_size,
            cfg.grpo_std_normalization,
            states=states,
        )
        metrics = {f"grpo/{key}": float(value) for key, value in grpo_metrics.items()}
        return Advantages(advantages.flatten(), None, None, keep.flatten(), metrics)

    def require_decisions(self, advantages: Advantages, ranks: SingleRank) -> None:
        """Some decision of the update, on any rank, belongs to a group that completed an episode."""
        if ranks.any(advantages.keep.any()):
            return
        if ranks.sum(advantages.metrics["grpo/groups_broken"]) > 0:  # a fault, not a config mistake: the update is skipped
            raise NonFiniteError("GRPO: every group that completed an episode has one an env ended with NaN/Inf output")
        raise ValueError("GRPO: no group completed an episode in this rollout, so there is nothing to learn from")


ALGORITHMS: dict[str, type[PPO] | type[GRPO]] = {"ppo": PPO, "grpo": GRPO}  # algorithm.algo -> its strategy


def minibatch_loss(
    policy: FlowPolicy,
    features: Any,
    new: ChainLogProb,
    data: PreparedBatch,
    mb_inds: Tensor,
    cfg: AlgorithmConfig,
    critic: bool,
    train_actor: bool,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss of decisions mb_inds (b,) of `data`, which the policy scores `new` ((b,) log-probs; features (b, ...):
    their encode()), and its metrics (scalar tensors). Computes and changes nothing else: no step, no check."""
    # policy loss
    mb_old_log_probs, behaviour_weight = data.old_log_probs[mb_inds], None
    anchor = mb_old_log_probs
    if data.behaviour_log_probs is not None and cfg.stale_rollouts == "behaviour":
        anchor = data.behaviour_log_probs[mb_inds]  # clip to the policy that sampled the chains
    elif data.behaviour_log_probs is not None:  # decoupled PPO: pi_prox / pi_behaviour
        behaviour_weight = (mb_old_log_probs - data.behaviour_log_probs[mb_inds]).exp()
    pg_loss, pg_metrics = ppo_policy_loss(new.log_prob, anchor, data.advantages[mb_inds], cfg.clip_eps, behaviour_weight)
    entropy = new.entropy.mean()
    actor_loss = pg_loss - cfg.ent_coef * entropy
    metrics = {"pg_loss": pg_loss, "entropy": entropy, **pg_metrics}

    # KL to the frozen reference
    if data.reference is not None:
        elements = num_log_prob_elements(policy.config)
        kl, kl_metrics = kl_to_reference(new, index_features(data.reference, mb_inds), elements, cfg.kl_estimator)
        actor_loss = actor_loss + cfg.kl_beta * kl.mean()
        metrics.update(kl_metrics)
    if not train_actor:
        actor_loss = torch.zeros(())

    # value loss
    if not critic:
        return actor_loss, metrics
    v_loss, v_metrics = value_loss(policy.value(features), data.returns[mb_inds], data.old_values[mb_inds], cfg.value_clip)
    metrics.update(v_loss=v_loss, **v_metrics)
    return actor_loss + cfg.vf_coef * v_loss, metrics
