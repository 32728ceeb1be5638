"""The learner: PPO/GRPO on recorded denoising chains. Its weight versions live in learner.weight_versions, its
checkpoints in learner.checkpoints.

`Learner` is plain Python (testable without Ray); the run wraps it in a Ray actor (learner.learner_actor.LearnerActor).
It owns the trainable policy (velocity field + noise head + critic) and one Adam optimiser with two
parameter groups (actor, critic) so each has its own learning rate and gradient-norm clip.

The policy is kept in eval mode for every forward pass, training ones included: eval mode only turns
off dropout and batch-norm updates (gradients still flow), and it is what makes the recomputed old
log-probs and the first minibatch's new log-probs bit-identical. The first minibatch of every
iteration checks ratio == 1 and raises NonDeterministicPolicyError otherwise.

algorithm.algo "grpo" replaces GAE with group-relative episode advantages (common.rl.grpo_advantages): the
critic is frozen (neither trained nor broadcast) and decisions of incomplete groups are dropped from the
batch. With algorithm.kl_beta > 0 the learner also holds a frozen reference policy, the starting weights, in
eval mode: never broadcast, saved with every checkpoint so a resumed run keeps the same reference.

With actors.policy_lag > 0 a rollout may come from an older weight version than the learner's. The learner
keeps the trainable tensors of every version still in flight, scores the chains with them (the behaviour
log-probs, compared with the actors' own as in the synchronous loop). algorithm.stale_rollouts chooses what
the ratio is clipped to: the behaviour policy (default), or, as decoupled PPO does, the proximal policy (the
weights before this iteration's first step) with pi_prox / pi_behaviour as a per-sample weight. Either way
the first minibatch's recomputed log-probs pass the same ratio == 1 check against the proximal weights.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from common.config import AlgorithmConfig, RunConfig
from common.diagnostics import (
    NonFiniteError,
    NonFiniteUpdateWarning,
    RandomInitError,
    check_finite_gradients,
    check_finite_tensors,
    check_ratio_is_one,
)
from common.flow import ChainLogProb, chain_log_prob, compile_steps, num_log_prob_elements, transition_kl
from common.observation import Observation
from common.policy import FlowPolicy, concat_features, index_features
from common.rl import gae, grpo_advantages, kl_to_reference, ppo_policy_loss, value_loss
from common.suites import make_suite
from common.trajectory import RolloutBatch, WeightsPayload
from learner.checkpoints import LearnerCheckpoint, TrainerState
from learner.data_parallel import SingleRank
from learner.micro_batches import AllocatorMemory, MicroBatchPlan, micro_batch_rows
from learner.numeric_checks import check_micro_batch, precision_gap, warn_on_behaviour_gap
from learner.sharding import hold, local_bytes, peak_bytes
from learner.single_batch import describe, micro_batch_line, minibatch_line
from learner.weight_versions import WeightVersions


def lr_scale(iteration: int, total_iterations: int, cfg: AlgorithmConfig) -> float:
    """Multiplier of the base learning rates at `iteration` (0-based): linear warm-up, then cosine or constant."""
    if iteration < cfg.lr_warmup_iters:
        return (iteration + 1) / cfg.lr_warmup_iters
    if cfg.lr_schedule == "constant":
        return 1.0
    progress = (iteration - cfg.lr_warmup_iters) / max(1, total_iterations - cfg.lr_warmup_iters)
    return cfg.lr_final_frac + (1.0 - cfg.lr_final_frac) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def frozen_reference(policy: FlowPolicy) -> FlowPolicy:
    """A frozen copy of `policy` in eval mode, for the KL to the starting weights.

    Only what can train is copied: parameters that do not require grad (a frozen VLM, a GRPO critic) and
    buffers (fixed normalisation) are shared with the policy, not duplicated. The copy's parameters
    require no grad, so no optimiser can reach them.
    """
    shared = [p for p in policy.parameters() if not p.requires_grad] + list(policy.buffers())
    reference = copy.deepcopy(policy, memo={id(t): t for t in shared})
    return reference.requires_grad_(False).eval()


def check_groups_share_initial_states(obs: Tensor, ends: Tensor, group_size: int) -> None:
    """GRPO's premise, checked on every rollout: the k-th episodes of a group's members (envs n with the same
    n // group_size) start from the same state. obs (T, N, obs_dim) is the state each decision saw, ends
    (T, N) bool marks decisions whose episode ended; an episode starts at t = 0 and after every end.
    Raises ValueError naming the group and the episode otherwise (unrelated returns would be compared)."""
    num_decisions, num_envs, obs_dim = obs.shape
    starts = torch.ones_like(ends)
    starts[1:] = ends[:-1]
    episode_index = ends.long().cumsum(0) - ends.long()
    num_episodes = int(episode_index.max()) + 1
    first = torch.zeros(num_envs, num_episodes, obs_dim, dtype=obs.dtype, device=obs.device)
    started = torch.zeros(num_envs, num_episodes, dtype=torch.bool, device=obs.device)
    t_idx, n_idx = starts.nonzero(as_tuple=True)
    first[n_idx, episode_index[t_idx, n_idx]] = obs[t_idx, n_idx]
    started[n_idx, episode_index[t_idx, n_idx]] = True
    first = first.view(num_envs // group_size, group_size, num_episodes, obs_dim)
    differ = (first != first[:, :1]).any(-1).any(1) & started.view(-1, group_size, num_episodes).all(1)  # (groups, E)
    if differ.any():
        group, episode = (int(i) for i in differ.nonzero()[0])
        raise ValueError(
            f"GRPO group {group} (envs {group * group_size}..{(group + 1) * group_size - 1} of the batch) started episode {episode} "
            "from different states: a group's members must reset to the same layouts (RolloutActor does with algorithm.algo=grpo)"
        )


def require_pretrained(policy: FlowPolicy, allow_random_init: bool) -> None:
    if policy.loaded_from is None and not allow_random_init:
        raise RandomInitError(
            "refusing to fine-tune a policy that was not loaded from a checkpoint: its weights are random, "
            "so RL would start from noise (the 'model outputs gibberish, KL explodes' failure). Load one with "
            "FlowPolicy.from_pretrained(dir) / --checkpoint DIR, or pass --allow-random-init if this is intended."
        )


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
    return concat_features([chain_log_prob(policy, index_features(features, slice(start, start + rows)), chains[start : start + rows],
                                           steps_in_one_pass=steps_in_one_pass) for start in range(0, len(chains), rows)])  # fmt: skip


@dataclass
class PreparedBatch:
    """A rollout flattened to B = T * N decisions, with the learner's own old log-probs and values."""

    obs: Observation  # (B, ...) torch, on the policy's device: state, and frames (or their vision tokens)/tokens when the policy reads them
    chains: Tensor  # (B, K+1, H, A)
    old_log_probs: Tensor  # (B,)  recomputed by the learner with the current weights, eval mode
    old_values: Tensor | None  # (B,)  None with GRPO (no critic)
    advantages: Tensor  # (B,)  normalised if configured; GRPO: the episode's group-relative advantage
    returns: Tensor | None  # (B,)  the critic's targets; None with GRPO
    metrics: dict[str, float]
    # encode(obs), computed once per iteration and reused in every epoch and minibatch when no trainable
    # parameter feeds encode() (the MLP; SmolVLA with a frozen VLM). None: re-encode every micro-batch.
    features: Any = None
    reference: ChainLogProb | None = None  # (B, ...) the reference policy's scores of the chains, when kl_beta > 0
    # (B,) the learner's scores of the chains under the weights that sampled them, when those are older than the
    # current ones (actors.policy_lag > 0); None: the chains came from the current weights (behaviour = old).
    behaviour_log_probs: Tensor | None = None
    # (B_all,) for each decision of the whole update (every rank's, in the order one learner would hold them), its row
    # in this batch, or -1 where another rank holds it; one learner alone holds every row, in order.
    rows_here: Tensor | None = None


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

    def advantages(self, policy: FlowPolicy, batch: RolloutBatch, t: dict[str, Tensor], features: Any, rows: int,
                   ranks: SingleRank) -> Advantages:  # fmt: skip
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


def task_groups(batch: RolloutBatch, over: Tensor, tasks: list[str]) -> dict[str, Tensor]:
    """The decisions of `over` (B,) of each of `tasks`, by the env each was sampled in (RolloutBatch.env_tasks): every
    task in the run's order, one this rank has none of included, so the ranks' statistics meet task by task."""
    if not batch.env_tasks:
        raise ValueError("algorithm.normalize_advantages_per_task needs the rollout's env_tasks (common.rollout.collect_rollout)")
    env_task = np.array(batch.env_tasks)
    return {task: over & torch.from_numpy(np.tile(env_task == task, batch.num_decisions)).to(over.device) for task in tasks}


class GRPO:
    """Group-relative episode advantages (common.rl.grpo_advantages). No critic: it is neither trained, broadcast nor
    warmed up. Only the decisions of groups whose episodes all completed, none broken by its env, enter the loss."""

    critic = False
    counts = ("grpo/groups", "grpo/groups_all_equal", "grpo/groups_broken", "grpo/groups_incomplete", "grpo/episodes_cut_off")

    def __init__(self, cfg: AlgorithmConfig):
        self.cfg = cfg

    def trains_actor(self, iteration: int) -> bool:
        return True

    def advantages(self, policy: FlowPolicy, batch: RolloutBatch, t: dict[str, Tensor], features: Any, rows: int,
                   ranks: SingleRank) -> Advantages:  # fmt: skip
        cfg = self.cfg
        ends = t["terminated"] | t["truncated"]
        check_groups_share_initial_states(torch.from_numpy(np.array(batch.obs.state)).to(ends.device), ends, cfg.group_size)
        advantages, keep, grpo_metrics = grpo_advantages(
            t["rewards"], t["discounts"], t["terminated"], t["truncated"], t["valid"], cfg.group_size, cfg.grpo_std_normalization
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


def update_shape(config: RunConfig) -> str:
    """One line for the banner: what the update of a full rollout does per iteration."""
    cfg = config.algorithm
    decisions = config.actors.num_actors * config.actors.envs_per_actor * config.actors.decisions_per_rollout
    sizes = cfg.minibatch_sizes(decisions)
    size = str(sizes[0]) if sizes[0] == sizes[-1] else f"{sizes[-1]}-{sizes[0]}"
    line = f"{decisions} decisions per iteration, {len(sizes)} minibatches x {size}, {cfg.update_epochs} epochs"
    if cfg.grad_accum > 1:
        line += f", micro-batches of <= {micro_batch_rows(cfg, decisions)}"
    if not ALGORITHMS[cfg.algo].critic:
        line += " (fewer decisions when GRPO drops incomplete groups)"
    if config.learner.num_learners > 1:
        line += f"; each of the {config.learner.num_learners} learner ranks scores and trains on the rollouts of its share of the actors"
        if config.learner.sharding == "fsdp":
            line += " and holds a 1/N shard of the weights, gradients and Adam state"
    return line


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


class Learner:
    def __init__(self, config: RunConfig, policy: FlowPolicy, memory: AllocatorMemory | None = None, ranks: SingleRank | None = None):
        """`memory`: what learner.speed.micro_batch_memory_gib reads (default: the CUDA allocator of the policy's device).
        `ranks`: this learner's place in a learner group (learner.data_parallel; default: alone)."""
        require_pretrained(policy, config.allow_random_init)
        self.ranks = ranks or SingleRank()
        # Every rank starts from rank 0's trainable weights, whatever each loaded.
        self.ranks.broadcast_from_first([p for p in policy.parameters() if p.requires_grad])
        self.config = config
        self.cfg = config.algorithm
        self.policy = policy.eval()
        self.algorithm = ALGORITHMS[self.cfg.algo](self.cfg)
        critic = set(policy.critic_parameter_names())
        if not self.algorithm.critic:  # the critic is neither trained nor broadcast
            for name, param in policy.named_parameters():
                if name in critic:
                    param.requires_grad_(False)
        self.iteration = 0  # completed updates
        self.version = 0  # weight version; bumps after every update
        self.env_steps = 0  # env steps of every rollout trained on; saved with checkpoints so a resume counts on
        # Non-finite updates: each one is rolled back and skipped; after learner.faults.nonfinite_backoff_after in a row the
        # learning rates are multiplied by learner.faults.nonfinite_lr_backoff (lr_backoff, saved with checkpoints).
        self.skipped_updates = 0
        self.nonfinite_streak = 0
        self.lr_backoff = 1.0
        # The KL reference: the starting weights, frozen (built only when used; load_trainer_state restores it).
        self.reference = frozen_reference(policy) if self.cfg.kl_beta > 0 else None
        if config.learner.speed.fused_attention:  # a VLA (RunConfig.validate); after the reference's copy, as compiling
            policy.fuse_attention()
        if config.learner.speed.compile_steps:  # after the reference's copy, which scores eagerly
            compile_steps(policy, "learner.speed.compile_steps")
        if config.learner.speed.compile_vision:  # a VLA (RunConfig.validate)
            policy.compile_vision("learner.speed.compile_vision")
        # After the reference's copy, which every rank holds whole, and before the optimiser, which takes the shards.
        self.sharding = hold(policy, self.ranks, config.learner.sharding)
        self.actor_params = [p for n, p in policy.named_parameters() if p.requires_grad and n not in critic]
        self.critic_params = [p for n, p in policy.named_parameters() if p.requires_grad and n in critic]
        self.optimizer = torch.optim.Adam(
            [{"params": self.actor_params, "lr": self.cfg.actor_lr}, {"params": self.critic_params, "lr": self.cfg.critic_lr}],
            eps=1e-5,
            # One kernel per parameter group on a GPU instead of several per tensor; on the CPU the plain loop keeps
            # runs bit-reproducible against docs/results.md.
            fused=policy.obs_device.type == "cuda",
        )
        self.num_log_prob_elements = num_log_prob_elements(policy.config)
        self.weight_versions = WeightVersions(config.actors.policy_lag)  # what the rollouts in flight were sampled with
        memory = memory or (AllocatorMemory(policy.obs_device) if policy.obs_device.type == "cuda" else None)
        if config.learner.speed.micro_batch_memory_gib and memory is None:
            raise ValueError(f"learner.speed.micro_batch_memory_gib reads a GPU's allocator; this learner runs on {policy.obs_device}")
        self.plan = MicroBatchPlan(self.cfg, config.learner.speed.micro_batch_memory_gib, memory)  # the learner's, not the config's

    # -- weights --------------------------------------------------------------------------------

    def broadcast(self, copy: bool = True) -> WeightsPayload:
        """The current version's trainable tensors; copy=False for a payload serialised at once (WeightsPayload.from_state)."""
        return WeightsPayload.from_state(self.version, self.record_version(), copy=copy)

    def record_version(self) -> dict[str, Tensor]:
        """The current version's trainable tensors, checked finite and kept while rollouts sampled with them are in flight
        (what a learner rank that publishes nothing itself does at each publication)."""
        state = self.sharding.full(self.policy.broadcast_state())
        check_finite_tensors(state, f"weights version {self.version} before publishing")
        self.weight_versions.record(self.iteration, self.version, state)
        return state

    def in_flight_versions(self) -> list[int]:
        """The weight versions that sample iterations k, ..., k + policy_lag (k = completed iterations). Call after broadcast()."""
        return self.weight_versions.in_flight(self.iteration, self.version)

    def trainable_state(self) -> dict[str, Tensor]:
        return {name: p for name, p in self.policy.named_parameters() if p.requires_grad}

    # -- one PPO iteration ------------------------------------------------------------------------

    def precision(self) -> torch.autocast:
        """learner.speed.precision: bfloat16 scores and updates under torch.autocast (weights and optimiser stay float32).
        Without its cast cache: autocast would keep the casts of trainable weights until the context closes, after the
        whole update, so every optimiser step, and a lagged rollout's scoring under swapped-in weights, would see the
        weights as they were when first cast."""
        device = self.policy.obs_device.type
        return torch.autocast(device, dtype=torch.bfloat16, enabled=self.config.learner.speed.precision == "bfloat16", cache_enabled=False)

    def prepare(self, batch: RolloutBatch) -> PreparedBatch:
        """Recompute old log-probs with the current weights (eval mode), then the advantages: GAE on the critic's
        values (PPO), or group-relative episode advantages keeping only complete groups' decisions (GRPO).
        With a KL reference, also its scores of the same chains."""
        with torch.no_grad(), self.precision(), self.sharding.whole():
            return self._prepare(batch)

    def normalization_groups(self, batch: RolloutBatch, over: Tensor) -> dict[str | None, Tensor]:
        """The decisions whose advantages are normalised together: all of `over` (key None), or each task's."""
        if not self.cfg.normalize_advantages_per_task:
            return {None: over}
        return task_groups(batch, over, make_suite(self.config.env).tasks())

    def _prepare(self, batch: RolloutBatch) -> PreparedBatch:
        policy, cfg = self.policy, self.cfg
        with self.ranks.together("learner.prepare"):  # this rank's rollouts, scored
            batch.validate()  # where the rollout enters the learner: NaN/Inf in it rolls the iteration back as any other
            read = ("chains", "rewards", "discounts", "terminated", "truncated", "log_probs", "valid")
            t = {name: tensor.to(policy.obs_device) for name, tensor in batch.tensors(read).items()}
            b_obs = batch.obs.flatten_leading().to_torch(policy.obs_device)  # (B, ...)
            b_chains = t["chains"].flatten(0, 1)  # (B, K+1, H, A)
            rows = self.plan.rows(len(b_chains))  # the most rows the update's model sees at once
            one_pass = self.config.learner.speed.steps_in_one_pass  # the update's passes score the same way
            features = encode_in_chunks(policy, b_obs, rows)
            old = score_in_chunks(policy, features, b_chains, rows, one_pass)
            # Version -1: an actor's weights as it loaded them from the checkpoint, before any broadcast (tests, tools);
            # the caller vouches that they are the learner's current ones, and the behaviour gap would show otherwise.
            lag = self.version - batch.weight_version if batch.weight_version >= 0 else 0
            behaviour = old
            if lag:
                with self.weight_versions.weights_of(policy, batch.weight_version, self.version):
                    behaviour_features = encode_in_chunks(policy, b_obs, rows) if policy.encoder_is_trainable else features
                    behaviour = score_in_chunks(policy, behaviour_features, b_chains, rows, one_pass)
            behaviour_gap = (behaviour.log_prob - t["log_probs"].flatten()).abs()
            metrics = {
                "logprob/old_mean": old.log_prob.mean().item(),
                "logprob/per_element": old.log_prob_per_element.mean().item(),
                "logprob/behaviour_gap_max": behaviour_gap.max().item(),  # > 0: another precision or device, or a bug
                "policy/sigma_mean": old.std.mean().item(),
                "policy/entropy": old.entropy.mean().item(),
            }
            advantages = self.algorithm.advantages(policy, batch, t, features, rows, self.ranks)
            b_values, b_advantages, b_returns = advantages.values, advantages.advantages, advantages.returns
            metrics.update(advantages.metrics)
            reference = None
            if self.reference is not None:
                # A frozen encoder is shared with the reference (frozen_reference), so its features are the policy's.
                ref_features = encode_in_chunks(self.reference, b_obs, rows) if policy.encoder_is_trainable else features
                reference = score_in_chunks(self.reference, ref_features, b_chains, rows, one_pass)
                kl, _ = kl_to_reference(old, reference, self.num_log_prob_elements, cfg.kl_estimator)
                metrics.update({
                    "kl_ref/mean": kl.mean().item(),
                    "kl_ref/max": kl.max().item(),
                    "kl_ref/exact_mean": (transition_kl(old, reference, "sum") / self.num_log_prob_elements).mean().item(),
                    "logprob/reference_per_element": reference.log_prob_per_element.mean().item(),
                })  # fmt: skip
            finite = {"old_log_probs": old.log_prob, "behaviour_log_probs": behaviour.log_prob, "advantages": b_advantages}
            finite |= {} if b_values is None else {"values": b_values}
            check_finite_tensors(finite, "learner.prepare")
            warn_on_behaviour_gap(metrics["logprob/behaviour_gap_max"], self.config.learner.behaviour_gap_warn, batch.actor_precision,
                                  policy.precision, batch.weight_version)  # fmt: skip
            if self.config.learner.speed.precision == "bfloat16":
                metrics["logprob/precision_gap_max"] = precision_gap(policy, b_obs, b_chains, old.log_prob, one_pass, cfg.clip_eps)
        # Across the ranks: the decisions that enter the loss, and the advantages normalised over them.
        self.algorithm.require_decisions(advantages, self.ranks)
        if advantages.normalize_over is not None:
            b_advantages = b_advantages.clone()
            for task, over in self.normalization_groups(batch, advantages.normalize_over).items():
                if task is not None:  # the scale each task's advantages had, over every rank's decisions of it
                    metrics[f"values/task/{task}/advantage_raw_std"] = self.ranks.std(b_advantages[over])
                b_advantages[over] = self.ranks.normalize(b_advantages[over])
        cached = None if policy.encoder_is_trainable else features
        if lag:
            weight = (old.log_prob - behaviour.log_prob).exp()
            metrics.update({"ppo/behaviour_weight_min": weight.min().item(), "ppo/behaviour_weight_max": weight.max().item()})
        data = PreparedBatch(b_obs, b_chains, old.log_prob, b_values, b_advantages, b_returns, metrics, cached, reference,
                             behaviour_log_probs=behaviour.log_prob if lag else None)  # fmt: skip
        # Decisions of episodes an env broke (NaN/Inf output) never enter the loss, nor those the algorithm leaves out.
        keep_decisions = t["valid"].flatten().to(b_advantages.device)
        if not self.ranks.any(keep_decisions.any()):
            raise NonFiniteError("every decision of this rollout belongs to an episode that an env ended with NaN/Inf output")
        if advantages.keep is not None:
            keep_decisions &= advantages.keep
        if not keep_decisions.all():
            kept = keep_decisions.nonzero().squeeze(1)
            if not len(kept) and self.sharding.sharded:  # a row for the zero-weight passes it runs in step with the others
                kept = torch.zeros(1, dtype=torch.int64, device=kept.device)
            data = index_features(data, kept)
        positions, total = self.ranks.decision_order(keep_decisions.view(batch.num_decisions, batch.num_envs))
        data.rows_here = torch.full((total,), -1, dtype=torch.int64)
        data.rows_here[positions.cpu()] = torch.arange(len(positions))
        return data

    def update(self, batch: RolloutBatch, verbose: bool = False) -> dict[str, float]:
        """One iteration, all or nothing: a NaN/Inf anywhere (rollout, log-prob, ratio, value, advantage, loss,
        gradient, or the weights after a step) rolls the weights and the optimiser back to their state before the
        iteration, and the update is skipped and counted. Returns metrics."""
        before = ({name: p.detach().clone() for name, p in self.trainable_state().items()}, copy.deepcopy(self.optimizer.state_dict()))
        decisions = batch.num_decisions * batch.num_envs
        while True:
            try:
                with self.precision():
                    metrics = self._update(batch, verbose)
                break
            except NonFiniteError as exc:
                self._roll_back(before)
                return self._skip_update(batch, exc)
            except torch.OutOfMemoryError as exc:
                self._roll_back(before)
                if not self.config.learner.faults.split_on_out_of_memory or self.plan.rows(decisions) == 1:
                    raise
                error = str(exc).splitlines()[0]
            # Out of the except block, so the error's frames, and the tensors they hold, are gone before the retry.
            self.plan.split_after_out_of_memory(decisions, error, self.iteration)
        self.nonfinite_streak = 0
        metrics.update({"faults/skipped_updates": self.skipped_updates, "faults/lr_backoff": self.lr_backoff})
        if self.plan.out_of_memory_splits:
            metrics["faults/grad_accum"] = self.plan.grad_accum
        if self.config.learner.speed.micro_batch_memory_gib:
            metrics["ppo/micro_batch_rows"] = self.plan.rows(decisions)
        if self.ranks.size > 1:  # the figures of the rank that holds the most
            held = {**self.state_bytes(), "peak_bytes": peak_bytes(self.policy.obs_device)}
            metrics.update({f"memory/rank_{name}": self.ranks.max(value) for name, value in held.items()})
        return metrics

    def state_bytes(self) -> dict[str, int]:
        """The bytes this rank holds of the policy's parameters, of their gradients and of the optimiser's state (a
        sharded learner's shards; the KL reference, held whole, not counted)."""
        optimizer = [value for state in self.optimizer.state.values() for value in state.values() if isinstance(value, Tensor)]
        return {
            "parameter_bytes": local_bytes(list(self.policy.parameters())),
            "gradient_bytes": local_bytes([p.grad for p in self.policy.parameters() if p.grad is not None]),
            "optimizer_bytes": local_bytes(optimizer),
        }

    def _roll_back(self, before: tuple[dict[str, Tensor], dict[str, Any]]) -> None:
        """The trainable weights and the optimiser as they were before the iteration."""
        with torch.no_grad():
            for name, param in self.trainable_state().items():
                param.copy_(before[0][name])
        self.optimizer.load_state_dict(before[1])

    def _skip_update(self, batch: RolloutBatch, error: NonFiniteError) -> dict[str, float]:
        """Count a rolled-back iteration; after nonfinite_backoff_after in a row, back the learning rates off."""
        self.iteration += 1  # the schedule and the minibatch order move on; the weight version does not
        self.env_steps += self.ranks.sum(batch.env_steps)  # sampled, so counted, though not trained on
        self.skipped_updates += 1
        self.nonfinite_streak += 1
        backoff = ""
        if self.nonfinite_streak >= self.config.learner.faults.nonfinite_backoff_after:
            self.lr_backoff *= self.config.learner.faults.nonfinite_lr_backoff
            self.nonfinite_streak = 0
            backoff = f"; {self.config.learner.faults.nonfinite_backoff_after} in a row: learning rates now x{self.lr_backoff:g}"
        warnings.warn(
            f"iteration {self.iteration}: update skipped, weights and optimiser rolled back to their state before it ({error}){backoff}",
            NonFiniteUpdateWarning,
            stacklevel=2,
        )
        return {"faults/skipped_update": 1.0, "faults/skipped_updates": self.skipped_updates, "faults/lr_backoff": self.lr_backoff,
                "ppo/actor_lr": 0.0, "ppo/critic_lr": 0.0}  # fmt: skip

    def _update(self, batch: RolloutBatch, verbose: bool) -> dict[str, float]:
        """PPO (or GRPO) on one rollout, top to bottom: the old log-probs and advantages, the learning rates, then epochs x
        minibatches, each one optimiser step over the plan's micro-batches. The shell around it (update) rolls back."""
        cfg, policy, plan, speed = self.cfg, self.policy, self.plan, self.config.learner.speed
        policy.eval()
        data = self.prepare(batch)
        if verbose:
            print(describe(batch, data), flush=True)
        train_actor = self.algorithm.trains_actor(self.iteration)
        scale = lr_scale(self.iteration, self.config.iterations, cfg)
        scale *= self.lr_backoff
        self.optimizer.param_groups[0]["lr"] = cfg.actor_lr * scale if train_actor else 0.0
        self.optimizer.param_groups[1]["lr"] = cfg.critic_lr * scale

        generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + self.iteration)
        batch_size = len(data.rows_here)  # every rank's decisions
        minibatch_sizes = cfg.minibatch_sizes(batch_size)
        history: dict[str, list[float]] = {}
        first_ratio_deviation = 0.0  # max |ratio - 1| over the first minibatch (the old log-probs' weights)
        optimizer_steps, stopped_early = 0, False
        for epoch in range(cfg.update_epochs):
            b_inds = torch.randperm(batch_size, generator=generator)
            for index, mb_inds in enumerate(b_inds.split(minibatch_sizes)):
                where = f"epoch {epoch} minibatch {index}"
                self.optimizer.zero_grad(set_to_none=True)
                here = data.rows_here[mb_inds]  # this rank's share of the minibatch
                terms: dict[str, list[tuple[float, int]]] = {}  # metric -> (value, rows) per micro-batch
                with self.ranks.together(where):
                    checks = self.sharding.checks()
                    for micro_index, micro in enumerate(self.sharding.micro_batches(plan.split(here[here >= 0]))):
                        padding = micro is None  # a pass a sharded rank runs in step with the others', over a row it holds
                        micro = torch.zeros(1, dtype=torch.int64) if padding else micro
                        measured = not padding and plan.measures(micro_index, train_actor)
                        allocated = plan.memory.allocated() if measured else 0
                        features = policy.encode(data.obs.index(micro)) if data.features is None else index_features(data.features, micro)
                        new = chain_log_prob(policy, features, data.chains[micro], speed.recompute_steps,
                                             speed.steps_in_one_pass)  # fmt: skip
                        loss, metrics = minibatch_loss(policy, features, new, data, micro, cfg, self.algorithm.critic, train_actor)
                        if padding:
                            (loss * 0.0).backward()
                            continue
                        logratio = new.log_prob - data.old_log_probs[micro]
                        with checks:
                            check_micro_batch(new, logratio, metrics, where)
                            if optimizer_steps == 0:
                                deviation = check_ratio_is_one(logratio, policy, cfg.ratio_tolerance)
                                first_ratio_deviation = max(first_ratio_deviation, deviation)
                        if verbose:
                            print(micro_batch_line(new, logratio))
                        (loss * (len(micro) / len(mb_inds))).backward()  # the minibatch's mean over every rank's decisions
                        for key, value in metrics.items():
                            terms.setdefault(key, []).append((float(value.detach()), len(micro)))
                        if measured:
                            plan.size_from(allocated, len(micro), minibatch_sizes[0])
                    checks.raise_first()
                self.sharding.reduce_gradients(self.actor_params + self.critic_params)
                check_finite_gradients(policy, f"learner.update {where}")
                actor_grad_norm = torch.nn.utils.clip_grad_norm_(self.actor_params, cfg.max_grad_norm) if train_actor else torch.zeros(())
                critic_grad_norm = torch.nn.utils.clip_grad_norm_(self.critic_params, cfg.max_grad_norm)
                self.optimizer.step()
                check_finite_tensors(self.trainable_state(), f"weights after the optimiser step of {where}")
                optimizer_steps += 1
                mb_metrics = self.ranks.minibatch_means(terms)
                mb_metrics["actor_grad_norm"] = float(actor_grad_norm)
                if self.critic_params:  # none with GRPO
                    mb_metrics["critic_grad_norm"] = float(critic_grad_norm)
                for key, value in mb_metrics.items():
                    history.setdefault(key, []).append(value)
                if verbose:
                    print(minibatch_line(where, mb_metrics))
                # KL early stopping on this minibatch's k3 approx-KL (measured before its step), as ReinFlow does
                stopped_early = cfg.target_kl is not None and train_actor and mb_metrics["approx_kl"] > cfg.target_kl
                if stopped_early:
                    break
            if stopped_early:
                break

        self.iteration += 1
        self.version += 1
        self.env_steps += self.ranks.sum(batch.env_steps)
        metrics = self.ranks.across_ranks(dict(data.metrics), int((data.rows_here >= 0).sum()), self.algorithm.counts)
        for key in ("pg_loss", "v_loss", "entropy", "approx_kl", "clipfrac", "explained_variance", "actor_grad_norm", "critic_grad_norm",
                    "kl_ref"):  # fmt: skip
            if key in history:  # v_loss and explained_variance: PPO only; kl_ref: with kl_beta > 0
                metrics[f"losses/{key}"] = float(np.mean(history[key]))
        if "kl_ref_max" in history:
            metrics["losses/kl_ref_max"] = float(np.max(history["kl_ref_max"]))
        metrics.update({
            "losses/approx_kl_max": float(np.max(history["approx_kl"])),
            "ppo/ratio_min": float(np.min(history["ratio_min"])),
            "ppo/ratio_max": float(np.max(history["ratio_max"])),
            "ppo/first_minibatch_ratio_dev": float(self.ranks.max(first_ratio_deviation)),
            "ppo/optimizer_steps": optimizer_steps,
            "ppo/batch_size": batch_size,
            "ppo/num_minibatches": len(minibatch_sizes),
            "ppo/minibatch_size": minibatch_sizes[0],  # the largest: the others are at most one smaller
            "ppo/epochs_run": epoch + 1,
            "ppo/kl_early_stop": float(stopped_early),
            "ppo/actor_lr": self.optimizer.param_groups[0]["lr"],
            "ppo/critic_lr": self.optimizer.param_groups[1]["lr"],
        })  # fmt: skip
        return metrics

    # -- checkpoints ------------------------------------------------------------------------------

    def save_checkpoint(self, directory: str | Path) -> Path:
        """Policy, optimiser and counters, the weight versions in flight and the KL reference, written atomically. In a
        learner group every rank calls it (a sharded one gathers its shards) and rank 0 writes what a learner alone would."""
        check_finite_tensors(self.trainable_state(), f"weights version {self.version} before saving")
        policy_state = self.sharding.full(self.policy.state_dict()) if self.sharding.sharded else None
        optimizer = self.sharding.full_optimizer_state(self.optimizer.state_dict())
        if self.ranks.rank > 0:
            return Path(directory)
        versions = self.weight_versions
        state = TrainerState(optimizer, self.iteration, self.version, self.env_steps, self.config.fingerprint(), self.skipped_updates,
                             self.lr_backoff, versions.sampling_versions, versions.published)  # fmt: skip
        return LearnerCheckpoint(directory).save(self.policy, state, self.reference, policy_state)

    def load_trainer_state(self, directory: str | Path) -> None:
        """Restore optimiser, counters, weight versions in flight and KL reference (the policy itself is loaded with
        from_pretrained)."""
        checkpoint = LearnerCheckpoint(directory)
        state = checkpoint.trainer_state()
        # A checkpoint's parameter groups carry the fused flag of the machine that saved it: keep this machine's.
        fused = self.optimizer.defaults["fused"]
        optimizer = {**state.optimizer, "param_groups": [{**group, "fused": fused} for group in state.optimizer["param_groups"]]}
        self.optimizer.load_state_dict(self.sharding.optimizer_state_here(optimizer, self.actor_params + self.critic_params))
        self.iteration, self.version, self.env_steps = state.iteration, state.version, state.env_steps
        self.skipped_updates, self.lr_backoff = state.skipped_updates, state.lr_backoff
        self.weight_versions.restore(state.sampling_versions, state.published)
        if self.reference is not None:
            checkpoint.load_reference(self.reference, self.config.policy.sampling_overrides())
