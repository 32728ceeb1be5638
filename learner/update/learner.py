"""The learner: PPO/GRPO on recorded denoising chains. Its weight versions live in learner.update.weight_versions, its
checkpoints in learner.files.checkpoints.

`Learner` is plain Python (testable without Ray); the run wraps it in a Ray actor (learner.runtime.learner_actor.LearnerActor).
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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from common.config import AlgorithmConfig, RunConfig
from common.diagnostics import NonFiniteError, NonFiniteUpdateWarning, RandomInitError, check_finite_gradients, check_finite_tensors
from common.flow import ChainLogProb, chain_log_prob, compile_steps, num_log_prob_elements, transition_kl
from common.policy import FlowPolicy, index_features
from common.rl import kl_to_reference
from common.trajectory import RolloutBatch, WeightsPayload
from learner.files.checkpoints import LearnerCheckpoint, TrainerState
from learner.group.ranks import SingleRank
from learner.group.sharding import hold, local_bytes, peak_bytes
from learner.update.algorithms import ALGORITHMS, Advantages, decision_tasks, minibatch_loss, task_groups
from learner.update.batch import PreparedBatch
from learner.update.demonstration_term import DemonstrationTerm
from learner.update.micro_batches import AllocatorMemory, MicroBatchPlan, micro_batch_rows
from learner.update.numeric_checks import precision_gap, warn_on_behaviour_gap
from learner.update.scoring import RolloutScores, score_rollout
from learner.update.task_figures import TaskFigures
from learner.update.watch import UpdateWatch
from learner.update.weight_versions import WeightVersions

# The rollout's tensors the update reads, on the policy's device.
ROLLOUT_TENSORS = ("chains", "rewards", "discounts", "terminated", "truncated", "log_probs", "valid")


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


def require_pretrained(policy: FlowPolicy, allow_random_init: bool) -> None:
    if policy.loaded_from is None and not allow_random_init:
        raise RandomInitError(
            "refusing to fine-tune a policy that was not loaded from a checkpoint: its weights are random, "
            "so RL would start from noise (the 'model outputs gibberish, KL explodes' failure). Load one with "
            "FlowPolicy.from_pretrained(dir) / --checkpoint DIR, or pass --allow-random-init if this is intended."
        )


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


class Minibatches:
    """(where, rows) of every minibatch of an update over `batch_size` decisions: algorithm.update_epochs permutations
    drawn from `seed`, each split into the configured minibatch sizes. A permutation is drawn when its epoch starts, so
    stopping early draws no more."""

    def __init__(self, batch_size: int, cfg: AlgorithmConfig, seed: int):
        self.batch_size, self.epochs = batch_size, cfg.update_epochs
        self.sizes = cfg.minibatch_sizes(batch_size)
        self.generator = torch.Generator().manual_seed(seed)
        self.epochs_started = 0

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        for epoch in range(self.epochs):
            self.epochs_started = epoch + 1
            for index, rows in enumerate(torch.randperm(self.batch_size, generator=self.generator).split(self.sizes)):
                yield f"epoch {epoch} minibatch {index}", rows


def suite_tasks(config: RunConfig) -> list[str]:
    """The run's tasks as its suite resolves env.task (importing the suite's simulator: a learner actor is handed them)."""
    from common.suites import make_suite

    return make_suite(config.env).tasks()


class Learner:
    def __init__(
        self,
        config: RunConfig,
        policy: FlowPolicy,
        memory: AllocatorMemory | None = None,
        ranks: SingleRank | None = None,
        tasks: Sequence[str] | None = None,
    ):
        """`memory`: what learner.speed.micro_batch_memory_gib reads (default: the CUDA allocator of the policy's device).
        `ranks`: this learner's place in a learner group (learner.group.ranks; default: alone). `tasks`: the run's tasks
        (env.task as its suite resolves it), handed over so that the learner imports no simulator; default: resolved
        here, by the suite."""
        require_pretrained(policy, config.allow_random_init)
        self.tasks = list(tasks) if tasks is not None else suite_tasks(config)
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
        self.demonstrations = DemonstrationTerm(config)  # stalled tasks' demonstrations (algorithm.stall_demos)
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

    def add_demonstrations(self, tasks: dict[str, int]) -> list[str]:
        """Stalled tasks' demonstrations into every update from the iteration given with each (learner.update.demonstration_term).
        Returns the tasks new to this learner."""
        return self.demonstrations.add(tasks, self.policy)

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

    def _prepare(self, batch: RolloutBatch) -> PreparedBatch:
        """prepare, top to bottom: this rank's rollout scored, its advantages, the reference's scores and the checks; then,
        over every rank, the advantages normalised and the decisions that enter the loss kept."""
        with self.ranks.together("learner.prepare"):  # this rank's rollouts, scored
            batch.validate()  # where the rollout enters the learner: NaN/Inf in it rolls the iteration back as any other
            tensors = {name: tensor.to(self.policy.obs_device) for name, tensor in batch.tensors(ROLLOUT_TENSORS).items()}
            scores = self._score_rollout(batch, tensors["chains"].flatten(0, 1))  # old and behaviour log-probs
            advantages = self.algorithm.advantages(self.policy, batch, tensors, scores.features, scores.rows, self.ranks)
            reference, kl, reference_figures = self._score_reference(scores)
            metrics = scores.figures(tensors["log_probs"].flatten()) | advantages.metrics | reference_figures
            task_figures = self._task_figures(batch, scores, advantages, kl)
            metrics |= self._check_scores(batch, scores, advantages, metrics["logprob/behaviour_gap_max"])
        # Across the ranks: the decisions that enter the loss, and the advantages normalised over them.
        self.algorithm.require_decisions(advantages, self.ranks)
        normalized, task_scales = self._normalize_advantages(batch, advantages)
        metrics |= task_scales | scores.behaviour_weight_figures()
        data = PreparedBatch(
            obs=scores.obs,
            chains=scores.chains,
            old_log_probs=scores.old.log_prob,
            old_values=advantages.values,
            advantages=normalized,
            returns=advantages.returns,
            metrics=metrics,
            features=None if self.policy.encoder_is_trainable else scores.features,
            reference=reference,
            behaviour_log_probs=None if scores.behaviour is None else scores.behaviour.log_prob,
            task_figures=task_figures,
        )
        return self._keep_decisions(batch, data, tensors["valid"], advantages.keep)

    def _score_rollout(self, batch: RolloutBatch, chains: Tensor) -> RolloutScores:
        """The chains (B, K+1, H, A) scored by the current weights and, where older ones sampled them, by those."""
        obs = batch.obs.flatten_leading().to_torch(self.policy.obs_device)  # (B, ...)
        # As many rows at once as the update's model sees, scored the way the update's passes score.
        scores = score_rollout(self.policy, obs, chains, self.plan.rows(len(chains)), self.config.learner.speed.steps_in_one_pass)
        # Version -1: an actor's weights as it loaded them from the checkpoint, before any broadcast (tests, tools);
        # the caller vouches that they are the learner's current ones, and the behaviour gap would show otherwise.
        if batch.weight_version >= 0 and batch.weight_version != self.version:
            with self.weight_versions.weights_of(self.policy, batch.weight_version, self.version):
                scores.behaviour = scores.rescore(self.policy)
        return scores

    def _score_reference(self, scores: RolloutScores) -> tuple[ChainLogProb | None, Tensor | None, dict[str, float]]:
        """With a KL reference: its scores of the chains, the old policy's per-decision KL to it, and their figures."""
        if self.reference is None:
            return None, None, {}
        # A frozen encoder is shared with the reference (frozen_reference), so its features are the policy's.
        reference = scores.rescore(self.reference)
        kl, _ = kl_to_reference(scores.old, reference, self.num_log_prob_elements, self.cfg.kl_estimator)
        figures = {
            "kl_ref/mean": kl.mean().item(),
            "kl_ref/max": kl.max().item(),
            "kl_ref/exact_mean": (transition_kl(scores.old, reference, "sum") / self.num_log_prob_elements).mean().item(),
            "logprob/reference_per_element": reference.log_prob_per_element.mean().item(),
        }
        return reference, kl, figures

    def _task_figures(
        self, batch: RolloutBatch, scores: RolloutScores, advantages: Advantages, kl_ref: Tensor | None
    ) -> TaskFigures | None:
        """A multi-task rollout's per-decision figures, kept by task (learner.update.task_figures); None for one task."""
        if len(self.tasks) == 1 or not batch.env_tasks:
            return None
        figures = TaskFigures(self.tasks, decision_tasks(batch, self.tasks), self.cfg.clip_eps)
        figures.add_prepared("sigma", scores.old.std.flatten(1).mean(1))
        figures.add_prepared("action_abs", scores.chains[:, -1].abs().flatten(1).mean(1))
        if advantages.values is not None:
            figures.add_prepared("returns", advantages.returns)
            figures.add_prepared("residual", advantages.returns - advantages.values)
        if kl_ref is not None:
            figures.add_prepared("kl_ref", kl_ref)
        return figures

    def _check_scores(self, batch: RolloutBatch, scores: RolloutScores, advantages: Advantages, behaviour_gap: float) -> dict[str, float]:
        """The scores and advantages finite (NonFiniteError), a warning where the actors' behaviour log-probs lie further
        than learner.behaviour_gap_warn from the learner's; under bfloat16, the gap to float32 scores (precision_gap)."""
        finite = {
            "old_log_probs": scores.old.log_prob,
            "behaviour_log_probs": scores.behaviour_log_probs,
            "advantages": advantages.advantages,
        }
        finite |= {} if advantages.values is None else {"values": advantages.values}
        check_finite_tensors(finite, "learner.prepare")
        threshold = self.config.learner.behaviour_gap_warn
        warn_on_behaviour_gap(behaviour_gap, threshold, batch.actor_precision, self.policy.precision, batch.weight_version)
        if self.config.learner.speed.precision != "bfloat16":
            return {}
        gap = precision_gap(self.policy, scores.obs, scores.chains, scores.old.log_prob, scores.steps_in_one_pass, self.cfg.clip_eps)
        return {"logprob/precision_gap_max": gap}

    def _normalize_advantages(self, batch: RolloutBatch, advantages: Advantages) -> tuple[Tensor, dict[str, float]]:
        """The advantages normalised over every rank's decisions of advantages.normalize_over, each task's apart with
        algorithm.normalize_advantages_per_task, and the scale each task's had; as they are where the algorithm says none."""
        over = advantages.normalize_over
        if over is None:
            return advantages.advantages, {}
        groups = task_groups(batch, over, self.tasks) if self.cfg.normalize_advantages_per_task else {None: over}
        normalized, task_scales = advantages.advantages.clone(), {}
        for task, rows in groups.items():
            if task is not None:  # the scale each task's advantages had, over every rank's decisions of it
                task_scales[f"values/task/{task}/advantage_raw_std"] = self.ranks.std(normalized[rows])
            normalized[rows] = self.ranks.normalize(normalized[rows])
        return normalized, task_scales

    def _keep_decisions(self, batch: RolloutBatch, data: PreparedBatch, valid: Tensor, algorithm_keeps: Tensor | None) -> PreparedBatch:
        """`data` cut to the decisions that enter the loss, and the place of each in the whole update (rows_here). Decisions
        of episodes an env broke (NaN/Inf output) never enter it, nor those the algorithm leaves out."""
        keep = valid.flatten().to(data.advantages.device)
        if not self.ranks.any(keep.any()):
            raise NonFiniteError("every decision of this rollout belongs to an episode that an env ended with NaN/Inf output")
        if algorithm_keeps is not None:
            keep &= algorithm_keeps
        if not keep.all():
            kept = keep.nonzero().squeeze(1)
            task_figures = None if data.task_figures is None else data.task_figures.keep(kept)
            data = index_features(data, self.sharding.rows_to_hold(kept))
            data.task_figures = task_figures
        positions, total = self.ranks.decision_order(keep.view(batch.num_decisions, batch.num_envs))
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
        return {
            "faults/skipped_update": 1.0,
            "faults/skipped_updates": self.skipped_updates,
            "faults/lr_backoff": self.lr_backoff,
            "ppo/actor_lr": 0.0,
            "ppo/critic_lr": 0.0,
        }

    def _update(self, batch: RolloutBatch, verbose: bool) -> dict[str, float]:
        """PPO (or GRPO) on one rollout, top to bottom: the old log-probs and advantages, the learning rates, then epochs x
        minibatches, one optimiser step each, until the epochs end or the KL to the old policy passes its target. The
        shell around it (update) rolls back."""
        self.policy.eval()
        data = self.prepare(batch)
        watch = UpdateWatch(data, self.policy, self.cfg.ratio_tolerance, verbose)
        watch.rollout(batch)
        train_actor = self.algorithm.trains_actor(self.iteration)
        self._set_learning_rates(train_actor)
        self.demonstrations.start_update(self.iteration, train_actor)
        minibatches = Minibatches(len(data.rows_here), self.cfg, seed=self.config.seed * 1_000_003 + self.iteration)
        stopped_early = False
        for where, minibatch in minibatches:
            figures = self._minibatch_step(data, minibatch, where, train_actor, minibatches.sizes[0], watch)
            watch.step(where, figures)
            # KL early stopping on this minibatch's k3 approx-KL (measured before its step), as ReinFlow does
            stopped_early = self.cfg.target_kl is not None and train_actor and figures["approx_kl"] > self.cfg.target_kl
            if stopped_early:
                break
        self.iteration += 1
        self.version += 1
        self.env_steps += self.ranks.sum(batch.env_steps)
        return self._update_metrics(data, watch, minibatches, stopped_early)

    def _set_learning_rates(self, train_actor: bool) -> None:
        """The schedule's rates at this iteration, backed off after non-finite updates; the actor's 0 while it does not train."""
        scale = lr_scale(self.iteration, self.config.iterations, self.cfg)
        scale *= self.lr_backoff
        self.optimizer.param_groups[0]["lr"] = self.cfg.actor_lr * scale if train_actor else 0.0
        self.optimizer.param_groups[1]["lr"] = self.cfg.critic_lr * scale

    def _minibatch_step(
        self, data: PreparedBatch, minibatch: Tensor, where: str, train_actor: bool, largest: int, watch: UpdateWatch
    ) -> dict[str, float]:
        """One optimiser step on `minibatch` (rows of every rank's decisions, in the order one learner holds them; `largest`:
        the update's largest minibatch, which the plan's memory sizing is for): this rank's share in the plan's
        micro-batches, each loss backpropagated at its share of the minibatch's mean, then the gradients summed over the
        ranks, clipped and stepped. Returns the step's figures, over every rank's decisions."""
        self.optimizer.zero_grad(set_to_none=True)
        terms: dict[str, list[tuple[float, int]]] = {}  # figure -> (value, rows) per micro-batch
        with self.ranks.together(where):
            checks = self.sharding.checks()
            micro_batches = self.plan.split(data.rows_held(minibatch))
            padding = self.sharding.padding_passes(len(micro_batches))  # before any pass: a sharded group runs them in step
            for index, micro in enumerate(micro_batches):
                with self.plan.sizing(index, len(micro), largest, train_actor):
                    loss, metrics, new = self._micro_batch_loss(data, micro, train_actor)
                    watch.micro_batch(where, micro, new, metrics, checks)
                    (loss * (len(micro) / len(minibatch))).backward()  # the minibatch's mean over every rank's decisions
                for key, value in metrics.items():
                    terms.setdefault(key, []).append((float(value.detach()), len(micro)))
            terms |= self.demonstrations.backward(self.policy, self.ranks.size)  # once a task stalled (algorithm.stall_demos)
            self._padding_passes(data, padding, train_actor)
            checks.raise_first()
        self.sharding.reduce_gradients(self.actor_params + self.critic_params)
        check_finite_gradients(self.policy, f"learner.update {where}")
        grad_norms = self._clip_gradients(train_actor)
        self.optimizer.step()
        check_finite_tensors(self.trainable_state(), f"weights after the optimiser step of {where}")
        return self.ranks.minibatch_means(terms) | {name: float(norm) for name, norm in grad_norms.items()}

    def _padding_passes(self, data: PreparedBatch, passes: int, train_actor: bool) -> None:
        """`passes` zero-weight passes over a row this rank holds, which keep a sharded group's ranks in step."""
        for _ in range(passes):
            (self._micro_batch_loss(data, torch.zeros(1, dtype=torch.int64), train_actor)[0] * 0.0).backward()

    def _clip_gradients(self, train_actor: bool) -> dict[str, Tensor]:
        """Each parameter group's gradients clipped to algorithm.max_grad_norm; their norms before (the actor's 0 while
        it does not train; the critic's where there is one to train: GRPO has none)."""
        actor = torch.nn.utils.clip_grad_norm_(self.actor_params, self.cfg.max_grad_norm) if train_actor else torch.zeros(())
        critic = torch.nn.utils.clip_grad_norm_(self.critic_params, self.cfg.max_grad_norm)
        return {"actor_grad_norm": actor, "critic_grad_norm": critic} if self.critic_params else {"actor_grad_norm": actor}

    def _micro_batch_loss(self, data: PreparedBatch, rows: Tensor, train_actor: bool) -> tuple[Tensor, dict[str, Tensor], ChainLogProb]:
        """The loss of decisions `rows` of `data`, their metrics and their new scores, with gradients."""
        speed = self.config.learner.speed
        features = self.policy.encode(data.obs.index(rows)) if data.features is None else index_features(data.features, rows)
        new = chain_log_prob(self.policy, features, data.chains[rows], speed.recompute_steps, speed.steps_in_one_pass)
        loss, metrics = minibatch_loss(self.policy, features, new, data, rows, self.cfg, self.algorithm.critic, train_actor)
        return loss, metrics, new

    def _update_metrics(self, data: PreparedBatch, watch: UpdateWatch, minibatches: Minibatches, stopped_early: bool) -> dict[str, float]:
        """The iteration's metrics: the rollout's as prepared (over every rank), the steps' means and extremes, the plan."""
        metrics = self.ranks.across_ranks(dict(data.metrics), int((data.rows_here >= 0).sum()), self.algorithm.counts)
        if data.task_figures is not None:
            metrics.update(data.task_figures.metrics(self.ranks))
        history = watch.history
        for key in (
            "pg_loss",
            "v_loss",
            "entropy",
            "approx_kl",
            "clipfrac",
            "explained_variance",
            "actor_grad_norm",
            "critic_grad_norm",
            "kl_ref",
            "demo_bc_loss",
        ):
            if key in history:  # v_loss and explained_variance: PPO only; kl_ref: with kl_beta > 0; demo_bc_loss: after a stall
                metrics[f"losses/{key}"] = float(np.mean(history[key]))
        if "kl_ref_max" in history:
            metrics["losses/kl_ref_max"] = float(np.max(history["kl_ref_max"]))
        metrics.update(
            {
                "losses/approx_kl_max": float(np.max(history["approx_kl"])),
                "ppo/ratio_min": float(np.min(history["ratio_min"])),
                "ppo/ratio_max": float(np.max(history["ratio_max"])),
                "ppo/first_minibatch_ratio_dev": float(self.ranks.max(watch.first_ratio_deviation)),
                "ppo/optimizer_steps": watch.steps,
                "ppo/batch_size": minibatches.batch_size,
                "ppo/num_minibatches": len(minibatches.sizes),
                "ppo/minibatch_size": minibatches.sizes[0],  # the largest: the others are at most one smaller
                "ppo/epochs_run": minibatches.epochs_started,
                "ppo/kl_early_stop": float(stopped_early),
                "ppo/actor_lr": self.optimizer.param_groups[0]["lr"],
                "ppo/critic_lr": self.optimizer.param_groups[1]["lr"],
            }
        )
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
        state = TrainerState(
            optimizer,
            self.iteration,
            self.version,
            self.env_steps,
            self.config.fingerprint(),
            self.skipped_updates,
            self.lr_backoff,
            versions.sampling_versions,
            versions.published,
            dict(self.demonstrations.from_iteration),
        )
        return LearnerCheckpoint(directory).save(self.policy, state, self.reference, policy_state)

    def load_trainer_state(self, directory: str | Path) -> None:
        """Restore optimiser, counters, weight versions in flight, KL reference and stalled tasks' demonstrations (the
        policy itself is loaded with from_pretrained)."""
        checkpoint = LearnerCheckpoint(directory)
        state = checkpoint.trainer_state()
        # A checkpoint's parameter groups carry the fused flag of the machine that saved it: keep this machine's.
        fused = self.optimizer.defaults["fused"]
        optimizer = {**state.optimizer, "param_groups": [{**group, "fused": fused} for group in state.optimizer["param_groups"]]}
        self.optimizer.load_state_dict(self.sharding.optimizer_state_here(optimizer, self.actor_params + self.critic_params))
        self.iteration, self.version, self.env_steps = state.iteration, state.version, state.env_steps
        self.skipped_updates, self.lr_backoff = state.skipped_updates, state.lr_backoff
        self.weight_versions.restore(state.sampling_versions, state.published)
        self.add_demonstrations(state.demo_tasks)
        if self.reference is not None:
            checkpoint.load_reference(self.reference, self.config.policy.sampling_overrides())
