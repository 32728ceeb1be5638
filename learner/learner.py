"""The learner: PPO on recorded denoising chains, versioned weights, atomic checkpoints.

`Learner` is plain Python (testable without Ray); learner.main wraps it in a Ray actor (LearnerActor).
It owns the trainable policy (velocity field + noise head + critic) and one Adam optimiser with two
parameter groups (actor, critic) so each has its own learning rate and gradient-norm clip.

The policy is kept in eval mode for every forward pass, training ones included: eval mode only turns
off dropout and batch-norm updates (gradients still flow), and it is what makes the recomputed old
log-probs and the first minibatch's new log-probs bit-identical. The first minibatch of every
iteration checks ratio == 1 and raises NonDeterministicPolicyError otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from common.config import PPOConfig, RunConfig
from common.diagnostics import RandomInitError, check_finite_gradients, check_finite_tensors, check_ratio_is_one
from common.flow import chain_log_prob
from common.policy import FlowPolicy, write_directory_atomically
from common.rl import gae, normalize, ppo_policy_loss, value_loss
from common.trajectory import RolloutBatch, WeightsPayload

TRAINER_STATE_FILE = "trainer_state.pt"


def lr_scale(iteration: int, total_iterations: int, cfg: PPOConfig) -> float:
    """Multiplier of the base learning rates at `iteration` (0-based): linear warm-up, then cosine or constant."""
    if iteration < cfg.lr_warmup_iters:
        return (iteration + 1) / cfg.lr_warmup_iters
    if cfg.lr_schedule == "constant":
        return 1.0
    progress = (iteration - cfg.lr_warmup_iters) / max(1, total_iterations - cfg.lr_warmup_iters)
    return cfg.lr_final_frac + (1.0 - cfg.lr_final_frac) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def require_pretrained(policy: FlowPolicy, allow_random_init: bool) -> None:
    if policy.loaded_from is None and not allow_random_init:
        raise RandomInitError(
            "refusing to fine-tune a policy that was not loaded from a checkpoint: its weights are random, "
            "so RL would start from noise (the 'model outputs gibberish, KL explodes' failure). Load one with "
            "FlowPolicy.from_pretrained(dir) / --checkpoint DIR, or pass --allow-random-init if this is intended."
        )


def _numpy(values: Tensor | np.ndarray) -> np.ndarray:
    return np.asarray(values.detach() if isinstance(values, Tensor) else values, dtype=np.float64)


def _head(values: Tensor | np.ndarray, count: int = 6) -> str:
    flat = _numpy(values).ravel()
    return "[" + ", ".join(f"{v:+.4g}" for v in flat[:count]) + (", ...]" if len(flat) > count else "]")


def describe(batch: RolloutBatch, data: PreparedBatch) -> str:
    """Every per-decision quantity of one iteration, for --single-batch: shape, moments, first values."""
    quantities = {
        "rewards": batch.rewards, "discounts": batch.discounts, "terminated": batch.terminated, "truncated": batch.truncated,
        "behaviour log-prob (actor)": batch.log_probs, "old log-prob (learner)": data.old_log_probs,
        "per-element log-prob (actor)": batch.log_probs_per_element, "values": data.old_values,
        "advantages": data.advantages, "returns": data.returns,
    }  # fmt: skip
    lines = [f"single batch: {batch.num_decisions} decisions x {batch.num_envs} envs, {batch.env_steps} env steps"]
    for name, values in quantities.items():
        array = _numpy(values)
        lines.append(
            f"  {name:<30} shape {str(array.shape):<10} mean {array.mean():+.4g} std {array.std():.4g} "
            f"min {array.min():+.4g} max {array.max():+.4g} first {_head(array)}"
        )
    lines += [f"  {key:<30} {value:.6g}" for key, value in data.metrics.items()]
    return "\n".join(lines)


@dataclass
class PreparedBatch:
    """A rollout flattened to B = T * N decisions, with the learner's own old log-probs and values."""

    obs: Tensor  # (B, obs_dim)
    chains: Tensor  # (B, K+1, H, A)
    old_log_probs: Tensor  # (B,)  recomputed by the learner with the current weights, eval mode
    old_values: Tensor  # (B,)
    advantages: Tensor  # (B,)  normalised if configured
    returns: Tensor  # (B,)
    metrics: dict[str, float]


class Learner:
    def __init__(self, config: RunConfig, policy: FlowPolicy):
        require_pretrained(policy, config.allow_random_init)
        self.config = config
        self.cfg = config.learner
        self.policy = policy.eval()
        critic = set(policy.critic_parameter_names())
        self.actor_params = [p for n, p in policy.named_parameters() if p.requires_grad and n not in critic]
        self.critic_params = [p for n, p in policy.named_parameters() if p.requires_grad and n in critic]
        self.optimizer = torch.optim.Adam(
            [{"params": self.actor_params, "lr": self.cfg.actor_lr}, {"params": self.critic_params, "lr": self.cfg.critic_lr}],
            eps=1e-5,
        )
        self.iteration = 0  # completed updates
        self.version = 0  # weight version; bumps after every update

    # -- weights --------------------------------------------------------------------------------

    def broadcast(self) -> WeightsPayload:
        return WeightsPayload.from_state(self.version, self.policy.broadcast_state())

    # -- one PPO iteration ------------------------------------------------------------------------

    @torch.no_grad()
    def prepare(self, batch: RolloutBatch) -> PreparedBatch:
        """Recompute old log-probs and values with the current weights, then GAE (all in eval mode)."""
        policy, cfg = self.policy, self.cfg
        t = batch.tensors(RolloutBatch.PER_DECISION)
        num_decisions, num_envs = batch.num_decisions, batch.num_envs
        b_obs = t["obs"].flatten(0, 1)  # (B, obs_dim)
        b_chains = t["chains"].flatten(0, 1)  # (B, K+1, H, A)
        features = policy.encode(b_obs)
        old = chain_log_prob(policy, features, b_chains)
        b_values = policy.value(features)
        next_values = policy.value(policy.encode(t["next_obs"].flatten(0, 1))).view(num_decisions, num_envs)
        values = b_values.view(num_decisions, num_envs)
        advantages, returns = gae(t["rewards"], values, next_values, t["discounts"], t["terminated"], t["truncated"], cfg.gae_lambda)
        b_advantages = advantages.flatten()
        if cfg.normalize_advantages:
            b_advantages = normalize(b_advantages)
        behaviour_gap = (old.log_prob - t["log_probs"].flatten()).abs()
        metrics = {
            "logprob/old_mean": old.log_prob.mean().item(),
            "logprob/per_element": old.log_prob_per_element.mean().item(),
            "logprob/behaviour_gap_max": behaviour_gap.max().item(),  # > 0 only with weight lag or a bug
            "policy/sigma_mean": old.std.mean().item(),
            "policy/entropy": old.entropy.mean().item(),
            "values/mean": b_values.mean().item(),
            "values/advantage_raw_std": advantages.std().item(),
            "values/returns_mean": returns.mean().item(),
        }
        check_finite_tensors({"old_log_probs": old.log_prob, "values": b_values, "advantages": b_advantages}, "learner.prepare")
        return PreparedBatch(b_obs, b_chains, old.log_prob, b_values, b_advantages, returns.flatten(), metrics)

    def update(self, batch: RolloutBatch, verbose: bool = False) -> dict[str, float]:
        """One iteration: prepare, then clipped PPO epochs over shuffled minibatches. Returns metrics."""
        cfg, policy = self.cfg, self.policy
        policy.eval()
        data = self.prepare(batch)
        if verbose:
            print(describe(batch, data), flush=True)
        train_actor = self.iteration >= cfg.critic_warmup_iters
        scale = lr_scale(self.iteration, self.config.iterations, cfg)
        self.optimizer.param_groups[0]["lr"] = cfg.actor_lr * scale if train_actor else 0.0
        self.optimizer.param_groups[1]["lr"] = cfg.critic_lr * scale

        generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + self.iteration)
        batch_size = len(data.obs)
        minibatch_size = min(cfg.minibatch_size, batch_size)
        micro_size = max(1, minibatch_size // cfg.grad_accum)
        history: dict[str, list[float]] = {}
        first_ratio_deviation = 0.0  # max |ratio - 1| over the first minibatch
        optimizer_steps = 0
        stopped_early = False
        for epoch in range(cfg.update_epochs):
            b_inds = torch.randperm(batch_size, generator=generator)
            for start in range(0, batch_size - minibatch_size + 1, minibatch_size):
                mb_inds = b_inds[start : start + minibatch_size]
                self.optimizer.zero_grad(set_to_none=True)
                mb_metrics: dict[str, list[float]] = {}
                for micro in mb_inds.split(micro_size):
                    features = policy.encode(data.obs[micro])
                    new = chain_log_prob(policy, features, data.chains[micro])
                    if optimizer_steps == 0:  # no step yet this iteration: same weights as the old log-probs
                        deviation = check_ratio_is_one(new.log_prob - data.old_log_probs[micro], policy, cfg.ratio_tolerance)
                        first_ratio_deviation = max(first_ratio_deviation, deviation)
                    if verbose:
                        print(f"  new log-prob {_head(new.log_prob)}  ratio {_head((new.log_prob - data.old_log_probs[micro]).exp())}")

                    # policy loss
                    pg_loss, pg_metrics = ppo_policy_loss(new.log_prob, data.old_log_probs[micro], data.advantages[micro], cfg.clip_eps)
                    entropy = new.entropy.mean()

                    # value loss
                    new_values = policy.value(features)
                    v_loss, v_metrics = value_loss(new_values, data.returns[micro], data.old_values[micro], cfg.value_clip)

                    actor_loss = pg_loss - cfg.ent_coef * entropy if train_actor else torch.zeros(())
                    loss = (actor_loss + cfg.vf_coef * v_loss) * (len(micro) / minibatch_size)
                    check_finite_tensors({"pg_loss": pg_loss, "v_loss": v_loss, "entropy": entropy}, "learner.update")
                    loss.backward()
                    for key, value in {"pg_loss": pg_loss, "v_loss": v_loss, "entropy": entropy, **pg_metrics, **v_metrics}.items():
                        mb_metrics.setdefault(key, []).append(float(value.detach()))
                check_finite_gradients(policy, "learner.update")
                actor_grad_norm = torch.nn.utils.clip_grad_norm_(self.actor_params, cfg.max_grad_norm) if train_actor else torch.zeros(())
                critic_grad_norm = torch.nn.utils.clip_grad_norm_(self.critic_params, cfg.max_grad_norm)
                self.optimizer.step()
                optimizer_steps += 1
                mb_summary = {k: float(np.mean(v)) for k, v in mb_metrics.items()}
                mb_summary["ratio_min"] = min(mb_metrics["ratio_min"])
                mb_summary["ratio_max"] = max(mb_metrics["ratio_max"])
                mb_summary.update(actor_grad_norm=float(actor_grad_norm), critic_grad_norm=float(critic_grad_norm))
                for key, value in mb_summary.items():
                    history.setdefault(key, []).append(value)
                if verbose:
                    print(
                        f"  epoch {epoch} minibatch {start // minibatch_size}: " + " ".join(f"{k}={v:.4g}" for k, v in mb_summary.items())
                    )
                # KL early stopping on this minibatch's k3 approx-KL (measured before its step), as ReinFlow does
                if cfg.target_kl is not None and train_actor and mb_summary["approx_kl"] > cfg.target_kl:
                    stopped_early = True
                    break
            if stopped_early:
                break

        self.iteration += 1
        self.version += 1
        metrics = dict(data.metrics)
        for key in ("pg_loss", "v_loss", "entropy", "approx_kl", "clipfrac", "explained_variance", "actor_grad_norm", "critic_grad_norm"):
            metrics[f"losses/{key}"] = float(np.mean(history[key]))
        metrics.update({
            "losses/approx_kl_max": float(np.max(history["approx_kl"])),
            "ppo/ratio_min": float(np.min(history["ratio_min"])),
            "ppo/ratio_max": float(np.max(history["ratio_max"])),
            "ppo/first_minibatch_ratio_dev": float(first_ratio_deviation),
            "ppo/optimizer_steps": optimizer_steps,
            "ppo/epochs_run": epoch + 1,
            "ppo/kl_early_stop": float(stopped_early),
            "ppo/actor_lr": self.optimizer.param_groups[0]["lr"],
            "ppo/critic_lr": self.optimizer.param_groups[1]["lr"],
        })  # fmt: skip
        return metrics

    # -- checkpoints ------------------------------------------------------------------------------

    def save_checkpoint(self, directory: str | Path) -> Path:
        """Policy (save_pretrained) + optimiser/iteration state, written to a temp dir then renamed."""
        state = {"optimizer": self.optimizer.state_dict(), "iteration": self.iteration, "version": self.version,
                 "config_fingerprint": self.config.fingerprint()}  # fmt: skip

        def write(tmp: Path) -> None:
            self.policy.save_pretrained(tmp)
            torch.save(state, tmp / TRAINER_STATE_FILE)

        return write_directory_atomically(directory, write)

    def load_trainer_state(self, directory: str | Path) -> None:
        """Restore optimiser, iteration and version (the policy itself is loaded with from_pretrained)."""
        path = Path(directory) / TRAINER_STATE_FILE
        state = torch.load(path, weights_only=True)  # never plain pickle for files from disk
        self.optimizer.load_state_dict(state["optimizer"])
        self.iteration = int(state["iteration"])
        self.version = int(state["version"])
