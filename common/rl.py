"""RL math as pure functions of tensors: GAE over chunk decisions, PPO losses, KL estimators.

Each function documents its argument shapes and returns plain tensors or `(loss, metrics)`.
Vocabulary (used everywhere in the project):
  T decisions per env in a rollout, N envs; `b_` a flattened batch, `mb_` a minibatch.
  logratio = logp_new - logp_old, ratio = exp(logratio), approx_kl = k3 of (new, old),
  clipfrac = fraction of samples whose ratio left [1 - clip_eps, 1 + clip_eps].
"""

from __future__ import annotations

import torch
from torch import Tensor


def gae(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor,
    discounts: Tensor,
    terminated: Tensor,
    truncated: Tensor,
    gae_lambda: float,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over chunk-level decisions.

    All inputs are (T, N), row t = decision t of each env:
      rewards     the chunk's reward: sum_i gamma^i r_i over the env steps it executed
      values      V(s_t), the state the chunk was chosen in
      next_values V(s'_t), the state after the chunk (the final state of an episode that ended in it;
                  where the rollout stops mid-episode this is the bootstrap value)
      discounts   gamma ** (env steps the chunk executed): a chunk cut short by termination counts only
                  the steps it really took
      terminated  episode ended in a terminal state during the chunk: no bootstrap
      truncated   episode was cut by a time limit: bootstrap from next_values, but the trace stops
    gamma is thus per ENV STEP; lambda applies per decision.
    Returns (advantages, returns), each (T, N); returns = advantages + values (the critic's target).
    """
    num_steps = rewards.shape[0]
    not_terminal = 1.0 - terminated.float()
    continues = 1.0 - torch.maximum(terminated.float(), truncated.float())
    deltas = rewards + discounts * not_terminal * next_values - values
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[0])
    for t in reversed(range(num_steps)):
        running = deltas[t] + discounts[t] * gae_lambda * continues[t] * running
        advantages[t] = running
    return advantages, advantages + values


def ppo_policy_loss(logp_new: Tensor, logp_old: Tensor, advantages: Tensor, clip_eps: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped PPO surrogate. All inputs (B,). Returns (pg_loss, metrics)."""
    logratio = logp_new - logp_old
    ratio = logratio.exp()
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    pg_loss = torch.maximum(pg_loss1, pg_loss2).mean()
    with torch.no_grad():
        metrics = {
            "approx_kl": k3(logp_old, logp_new).mean(),  # KL(old || new) for samples of the old policy
            "clipfrac": ((ratio - 1.0).abs() > clip_eps).float().mean(),
            "ratio_min": ratio.min(),
            "ratio_max": ratio.max(),
            "logratio_abs_max": logratio.abs().max(),
        }
    return pg_loss, metrics


def value_loss(values: Tensor, returns: Tensor, old_values: Tensor, value_clip: float | None) -> tuple[Tensor, dict[str, Tensor]]:
    """0.5 * squared error (B,) -> scalar. With value_clip, the prediction is clipped around old_values
    and the larger of the two errors is used (PPO2's pessimistic value clipping)."""
    unclipped = (values - returns) ** 2
    if value_clip is None:
        v_loss = 0.5 * unclipped.mean()
    else:
        clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
        v_loss = 0.5 * torch.maximum(unclipped, (clipped - returns) ** 2).mean()
    with torch.no_grad():
        if returns.numel() > 1:
            explained_var = 1.0 - (returns - values).var() / returns.var().clamp_min(1e-8)
        else:
            explained_var = torch.tensor(float("nan"))
    return v_loss, {"explained_variance": explained_var}


# KL estimators (Schulman, "Approximating KL divergence"). Samples x come from `policy`;
# each returns a per-sample estimate (B,) of KL(policy || reference), with log r = ref - logp:
#   k1 = -log r                 unbiased, high variance, can be negative
#   k2 = (log r)^2 / 2          biased, low variance, >= 0
#   k3 = (r - 1) - log r        unbiased, low variance, >= 0  (the one used for KL-to-reference)
# Direction matters: swapping the arguments of k3 estimates nothing useful for samples of `policy`.


def k1(logp: Tensor, logp_ref: Tensor) -> Tensor:
    return logp - logp_ref


def k2(logp: Tensor, logp_ref: Tensor) -> Tensor:
    return 0.5 * (logp_ref - logp) ** 2


def k3(logp: Tensor, logp_ref: Tensor) -> Tensor:
    log_r = logp_ref - logp
    return torch.expm1(log_r) - log_r


def normalize(x: Tensor, eps: float = 1e-8) -> Tensor:
    return (x - x.mean()) / (x.std() + eps)
