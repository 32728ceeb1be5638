"""RL math as pure functions of tensors: GAE over chunk decisions, PPO losses, GRPO group advantages,
KL estimators and the KL-to-reference term.

Each function documents its argument shapes and returns plain tensors or `(loss, metrics)`.
Vocabulary (used everywhere in the project):
  T decisions per env in a rollout, N envs; `b_` a flattened batch, `mb_` a minibatch.
  logratio = logp_new - logp_old, ratio = exp(logratio), approx_kl = k3 of (new, old),
  clipfrac = fraction of samples whose ratio left [1 - clip_eps, 1 + clip_eps].
"""

from __future__ import annotations

import torch
from torch import Tensor

from common.flow import ChainLogProb, transition_kl


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


def ppo_policy_loss(
    logp_new: Tensor, logp_old: Tensor, advantages: Tensor, clip_eps: float, behaviour_weight: Tensor | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped PPO surrogate. All inputs (B,). Returns (pg_loss, metrics).

    logp_old is the proximal policy's: the learner's weights before this iteration's first step. When the
    chains were sampled by an older weight version (actors.policy_lag > 0), behaviour_weight (B,) is
    pi_prox / pi_behaviour, decoupled PPO's importance weight (Hilton et al. 2021, "Batch size-invariance
    for policy optimization"): the clip stays around the proximal policy, and each sample's clipped term is
    reweighted towards it. None: the chains came from the proximal policy itself (weight 1)."""
    logratio = logp_new - logp_old
    ratio = logratio.exp()
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    per_sample = torch.maximum(pg_loss1, pg_loss2)
    if behaviour_weight is not None:
        per_sample = behaviour_weight * per_sample
    pg_loss = per_sample.mean()
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
        # The first two moments of the returns and the residuals, from which the explained variance of several
        # micro-batches (or ranks) together follows (explained_variance_of_moments).
        returns64, residuals64 = returns.double(), (returns - values).double()
        moments = {
            "returns_mean": returns64.mean(),
            "returns_sq_mean": (returns64**2).mean(),
            "residual_mean": residuals64.mean(),
            "residual_sq_mean": (residuals64**2).mean(),
        }
    return v_loss, {"explained_variance": explained_var, **moments}


EXPLAINED_VARIANCE_MOMENTS = ("returns_mean", "returns_sq_mean", "residual_mean", "residual_sq_mean")


def explained_variance_of_moments(moments: dict[str, float], count: int) -> float:
    """1 - var(returns - values) / var(returns) over `count` decisions, from the means of returns, returns^2, residuals
    and residuals^2 over them (value_loss's moments, pooled): the unbiased variances, as torch.var gives them, their
    common factor count / (count - 1) cancelling; NaN below two decisions."""
    if count < 2:
        return float("nan")
    returns_var = moments["returns_sq_mean"] - moments["returns_mean"] ** 2
    residual_var = moments["residual_sq_mean"] - moments["residual_mean"] ** 2
    return 1.0 - residual_var / max(returns_var, 1e-8 * (count - 1) / count)


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
    """Zero mean, unit std; a single element (whose std is undefined) becomes 0."""
    if x.numel() < 2:
        return x - x.mean()
    return (x - x.mean()) / (x.std() + eps)


KL_ESTIMATORS = {"k1": k1, "k2": k2, "k3": k3}


def kl_to_reference(policy: ChainLogProb, reference: ChainLogProb, num_elements: int, estimator: str) -> tuple[Tensor, dict[str, Tensor]]:
    """KL(policy || reference) per chain and per log-prob element (B,), for chains sampled by the policy.

    `policy` and `reference` score the same recorded chains (B, K+1, H, A) (common.flow.chain_log_prob).
    Normalisation: the KL is measured on the chain's exact JOINT log-density (the "sum" aggregation,
    whatever policy.log_prob_normalization says), then divided by `num_elements`
    (common.flow.num_log_prob_elements), so it is per element like `log_prob_per_element`; k1 per element
    is exactly the difference of the two per-element log-probs. The division makes the coefficient beta
    mean the same thing at any chunk size. Feeding per-element-MEAN log-probs to k2/k3 instead would not
    estimate KL at all: with x = joint log-ratio, k3(x / D) ~ (x / D)^2 / 2, about KL / D^2, D times too small.
      k1, k2, k3  sample-based, on log r = joint log-ratio reference - policy (see `k3`). k3 of a long
                  chain is high-variance: exp(log r) of a joint log-ratio over thousands of elements
                  overflows long before the per-element KL is large.
      exact       the analytic KL between the two policies' Gaussian transitions at every recorded step
                  (common.flow.transition_kl), summed over the chain: zero variance, always >= 0. A flow
                  chain allows it because every transition is an explicit Gaussian.
    Returns (kl (B,), metrics with its mean and max).
    """
    if estimator == "exact":
        kl = transition_kl(policy, reference, "sum") / num_elements
    elif estimator in KL_ESTIMATORS:
        joint_logp = policy.log_prob_per_element * num_elements
        joint_logp_ref = reference.log_prob_per_element * num_elements
        kl = KL_ESTIMATORS[estimator](joint_logp, joint_logp_ref) / num_elements
    else:
        raise ValueError(f"estimator must be one of {[*KL_ESTIMATORS, 'exact']}, got {estimator!r}")
    with torch.no_grad():
        metrics = {"kl_ref": kl.mean(), "kl_ref_max": kl.max()}
    return kl, metrics


# GRPO (critic-free). G envs of one actor form a group: they reset to the same sequence of initial states
# (layouts), so the k-th episodes of a group's members are G rollouts of one initial state. Each episode's
# return is compared with its group's, (R - mean) / (std + eps), or R - mean in the Dr. GRPO variant, and
# that advantage applies to every decision of the episode.


def episode_returns(rewards: Tensor, discounts: Tensor, terminated: Tensor, truncated: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Split each env's decisions into episodes and give every decision its episode's return.

    Inputs (T, N) as in `gae`; every env starts a fresh episode at t = 0 (each rollout resets its envs).
    Returns, each (T, N):
      episode_index  int64: which of its env's episodes (0, 1, ...) the decision belongs to
      complete       bool: that episode ended (terminated or truncated) within the rollout. An episode cut
                     off by the rollout's end has no return: mask it out.
      returns        the episode's discounted return from its first state, sum_s gamma^s r_s over its env
                     steps (exactly what PPO maximises; algorithm.gamma = 1 gives the plain sum). Chunk rewards
                     are already discounted within the chunk, and `discounts` (gamma^steps) chain them.
                     For an incomplete episode it is the partial sum, meaningless: use `complete`.
    """
    ends = terminated | truncated
    num_steps = rewards.shape[0]
    to_go = torch.zeros_like(rewards)  # return from decision t to the end of its episode
    running = torch.zeros_like(rewards[0])
    for t in reversed(range(num_steps)):
        running = rewards[t] + discounts[t] * (~ends[t]).float() * running
        to_go[t] = running
    returns = torch.empty_like(rewards)
    returns[0] = to_go[0]
    for t in range(1, num_steps):
        returns[t] = torch.where(ends[t - 1], to_go[t], returns[t - 1])  # a new episode starts after an end
    ends_long = ends.long()
    episode_index = ends_long.cumsum(0) - ends_long  # ends strictly before t
    complete = ends_long.flip(0).cumsum(0).flip(0) > 0  # an end at or after t
    return episode_index, complete, returns


def group_advantages(returns: Tensor, std_normalization: bool, eps: float = 1e-4) -> tuple[Tensor, dict[str, Tensor]]:
    """Group-relative advantages of episode returns (num_groups, G) -> (num_groups, G).

    (R - mean) / (std + eps) with std_normalization (GRPO; the sample std, Bessel-corrected), else R - mean
    (Dr. GRPO, which keeps the reward's scale). Groups whose returns are all equal carry no signal: their
    advantages are exactly 0 (not 0 / eps noise) and they are counted in metrics["groups_all_equal"].
    """
    if returns.ndim != 2 or returns.shape[1] < 2:
        raise ValueError(f"returns must be (num_groups, G >= 2), got shape {tuple(returns.shape)}")
    centred = returns - returns.mean(1, keepdim=True)
    std = returns.std(1, keepdim=True)
    advantages = centred / (std + eps) if std_normalization else centred
    all_equal = (returns == returns[:, :1]).all(1)
    advantages = torch.where(all_equal[:, None], torch.zeros_like(advantages), advantages)
    metrics = {"groups_all_equal": all_equal.sum(), "group_return_std": std.mean()}  # NaN with no groups
    return advantages, metrics


def grpo_advantages(
    rewards: Tensor,
    discounts: Tensor,
    terminated: Tensor,
    truncated: Tensor,
    valid: Tensor,
    group_size: int,
    std_normalization: bool,
    eps: float = 1e-4,
    states: Tensor | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Per-decision GRPO advantages of a rollout whose env n belongs to group n // group_size.

    Inputs (T, N) as in `gae`, N a multiple of group_size; the k-th episodes of a group's members must share
    their initial state (the rollout's job): given `states` (T, N, D), the state each decision saw, a group episode whose
    members did not start alike is refused (ValueError naming the group and the episode: unrelated returns would be
    compared). valid (T, N) bool is False on every decision of an episode that
    its env broke (ended with NaN/Inf output; RolloutBatch.valid). The group-episode (g, k) counts only when
    all G members completed their k-th episode and none broke it; otherwise all its decisions are masked (a
    partial group would compare the short episodes, often the successes, among themselves, and a broken
    episode's return is cut short by the fault, not earned).
    Returns (advantages (T, N), mask (T, N) bool: decisions that belong in the loss, metrics). Metrics count
    the started group-episodes three ways: "groups" (used), "groups_broken" (complete, but a member broke),
    "groups_incomplete" (a member was cut off by the rollout's end).
    """
    num_decisions, num_envs = rewards.shape
    if num_envs % group_size:
        raise ValueError(f"{num_envs} envs do not split into groups of {group_size}")
    num_groups = num_envs // group_size
    episode_index, complete, returns = episode_returns(rewards, discounts, terminated, truncated)
    num_episodes = int(episode_index.max()) + 1
    device = rewards.device
    env_ids = torch.arange(num_envs, device=device).expand(num_decisions, num_envs)
    # (N, E) tables: every decision of an episode writes the same value, so repeated writes agree.
    table_returns = torch.zeros(num_envs, num_episodes, dtype=rewards.dtype, device=device)
    table_complete = torch.zeros(num_envs, num_episodes, dtype=torch.bool, device=device)
    table_started = torch.zeros(num_envs, num_episodes, dtype=torch.bool, device=device)
    table_valid = torch.zeros(num_envs, num_episodes, dtype=torch.bool, device=device)
    table_returns[env_ids, episode_index] = returns
    table_complete[env_ids, episode_index] = complete
    table_started[env_ids, episode_index] = True
    table_valid[env_ids, episode_index] = valid.to(device)
    if states is not None:
        check_groups_start_alike(states, episode_index, table_started, group_size)
    group_ended = table_complete.view(num_groups, group_size, num_episodes).all(1)  # (num_groups, E)
    group_broken = group_ended & ~table_valid.view(num_groups, group_size, num_episodes).all(1)
    group_complete = group_ended & ~group_broken
    group_started = table_started.view(num_groups, group_size, num_episodes).any(1)
    group_returns = table_returns.view(num_groups, group_size, num_episodes).transpose(1, 2)  # (num_groups, E, G)
    valid_advantages, metrics = group_advantages(group_returns[group_complete], std_normalization, eps)
    table_advantages = torch.zeros_like(group_returns)
    table_advantages[group_complete] = valid_advantages
    table_advantages = table_advantages.transpose(1, 2).reshape(num_envs, num_episodes)
    table_mask = group_complete.repeat_interleave(group_size, 0)  # (N, E)
    advantages = table_advantages[env_ids, episode_index]
    mask = table_mask[env_ids, episode_index]
    metrics.update(
        {
            "groups": group_complete.sum(),
            "groups_broken": group_broken.sum(),
            "groups_incomplete": (group_started & ~group_ended).sum(),
            "episodes_cut_off": (table_started & ~table_complete).sum(),
            "masked_decision_frac": 1.0 - mask.float().mean(),
            "episode_return": group_returns[group_complete].mean(),  # over complete groups; NaN with none
        }
    )
    return advantages, mask, metrics


def check_groups_start_alike(states: Tensor, episode_index: Tensor, started: Tensor, group_size: int) -> None:
    """GRPO's premise: the k-th episodes of a group's members start from the same state. states (T, N, D) the state each
    decision saw, episode_index (T, N) its episode, started (N, E) the env's episodes that began in the rollout."""
    num_envs, num_episodes = started.shape
    begins = torch.ones_like(episode_index, dtype=torch.bool)  # t = 0, or the decision after an episode's end
    begins[1:] = episode_index[1:] != episode_index[:-1]
    first = torch.zeros(num_envs, num_episodes, states.shape[-1], dtype=states.dtype, device=states.device)
    t_idx, n_idx = begins.nonzero(as_tuple=True)
    first[n_idx, episode_index[t_idx, n_idx]] = states[t_idx, n_idx]
    first = first.view(num_envs // group_size, group_size, num_episodes, -1)
    differ = (first != first[:, :1]).any(-1).any(1) & started.view(-1, group_size, num_episodes).all(1)  # (groups, E)
    if differ.any():
        group, episode = (int(i) for i in differ.nonzero()[0])
        raise ValueError(
            f"GRPO group {group} (envs {group * group_size}..{(group + 1) * group_size - 1} of the batch) started episode {episode} "
            "from different states: a group's members must reset to the same layouts (RolloutActor does with algorithm.algo=grpo)"
        )
