"""Prefix reuse: the learner's PPO update with encode() computed once per iteration (the default for a frozen
encoder) against re-encoding the observations in every micro-batch, side by side in one process.

    python bench/prefix_reuse.py                      # tiny SmolVLA (needs the smolvla extra + lerobot)
    python bench/prefix_reuse.py --backend mlp        # the state MLP, whose encode() is a normalisation

Both learners start from the same weights and see the same rollout (random frames, the real tokenizer,
chains sampled by the policy, so the ratio check runs for real). The re-encoding one differs only in
reporting encoder_is_trainable=True, which is what a trainable VLM would force. Prints `name: value` lines.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.config import AlgorithmConfig, PolicyConfig, RunConfig  # noqa: E402
from common.observation import Observation  # noqa: E402
from common.policy import FlowPolicy, build_policy, policy_class  # noqa: E402
from common.policy.smolvla.config import SmolVLAConfig  # noqa: E402
from common.rollout import decide  # noqa: E402
from common.trajectory import RolloutBatch  # noqa: E402
from learner.learner import Learner  # noqa: E402


def policy_config(backend: str, image_size: int) -> PolicyConfig:
    if backend == "mlp":
        return PolicyConfig(init_noise_std=0.0)
    smolvla = SmolVLAConfig(num_vlm_layers=2, max_state_dim=39, max_action_dim=4)
    return PolicyConfig(type="smolvla", image_size=image_size, chunk_size=4, num_steps=4, hidden_dim=64, init_noise_std=0.0,
                        smolvla=smolvla)  # fmt: skip


def synthetic_rollout(policy: FlowPolicy, decisions: int, envs: int, seed: int) -> RolloutBatch:
    """A (T=decisions, N=envs) record sampled by `policy` on random states and frames, no episode ending in it."""
    rng = np.random.default_rng(seed)
    total = (decisions + 1) * envs
    size = policy.config.image_size
    frames = rng.integers(0, 256, (total, len(policy.config.cameras), size, size, 3), dtype=np.uint8) if size else None
    tokens = policy.tokenize(["pick up the block and place it at the goal"] * total)
    obs = Observation(rng.normal(size=(total, policy.config.obs_dim)).astype(np.float32), frames, *(tokens or (None, None)))
    now, last = obs.index(slice(0, decisions * envs)), obs.index(slice(decisions * envs, total))
    decision = decide(policy, now, deterministic=False, generator=torch.Generator().manual_seed(seed))

    def per_decision(array: np.ndarray) -> np.ndarray:
        return array.reshape(decisions, envs, *array.shape[1:])

    return RolloutBatch(
        obs=Observation(**{name: per_decision(array) for name, array in now.present().items()}),
        chains=per_decision(decision.chain), rewards=rng.random((decisions, envs)).astype(np.float32),
        discounts=np.full((decisions, envs), 0.99**4, np.float32), terminated=np.zeros((decisions, envs), bool),
        truncated=np.zeros((decisions, envs), bool), valid=np.ones((decisions, envs), bool),
        log_probs=per_decision(decision.log_prob), log_probs_per_element=per_decision(decision.log_prob_per_element),
        bootstrap_at=np.stack([np.full(envs, decisions - 1), np.arange(envs)], axis=1).astype(np.int64),
        bootstrap_obs=Observation(last.state, last.images), episode_returns=np.zeros(0, np.float32),
        episode_successes=np.zeros(0, bool), episode_lengths=np.zeros(0, np.int64), episode_first=np.zeros(0, bool),
        weight_version=0, actor_index=0,
        sample_seconds=0.0, env_steps=0, actor_precision=policy.precision,
    )  # fmt: skip


def counting(policy: FlowPolicy, log: list[int]):
    """policy.encode, recording the batch size of every call."""
    encode = type(policy).encode

    def wrapped(obs: Observation):
        log.append(obs.batch_shape[0])
        return encode(policy, obs)

    return wrapped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("smolvla", "mlp"), default="smolvla")
    parser.add_argument("--decisions", type=int, default=25, help="T decisions per env")
    parser.add_argument("--envs", type=int, default=8, help="N envs (B = T * N decisions per update)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--minibatch", type=int, default=50)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    ppo = AlgorithmConfig(update_epochs=args.epochs, minibatch_size=args.minibatch, critic_warmup_iters=0, target_kl=None)
    config = RunConfig(policy=policy_config(args.backend, args.image_size), algorithm=ppo, allow_random_init=True)
    cached = build_policy(config.policy).eval()
    initial = {k: v.clone() for k, v in cached.state_dict().items()}
    cls = policy_class(config.policy.type)
    # The same model, but declaring a trainable encoder: the learner then encodes every micro-batch.
    reencoding_cls = type(f"Reencoding{cls.__name__}", (cls,), {"encoder_is_trainable": property(lambda self: True)})
    reencoding = reencoding_cls(config.policy).eval()
    batch = synthetic_rollout(cached, args.decisions, args.envs, seed=0)

    seconds: dict[str, list[float]] = {"cached": [], "reencode": []}
    final: dict[str, dict[str, torch.Tensor]] = {}
    calls: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, policy in (("cached", cached), ("reencode", reencoding)):
            policy.load_state_dict(initial)
            encoded_batches: list[int] = []
            policy.encode = counting(policy, encoded_batches)
            learner = Learner(config, policy)
            start = time.perf_counter()
            metrics = learner.update(batch)
            seconds[name].append(time.perf_counter() - start)
            del policy.encode
            calls[name] = len(encoded_batches)
            final[name] = {k: v.clone() for k, v in policy.state_dict().items()}
    weight_gap = max((final["cached"][k].float() - final["reencode"][k].float()).abs().max().item() for k in final["cached"])
    cached_s, reencode_s = statistics.median(seconds["cached"]), statistics.median(seconds["reencode"])
    print(f"backend: {args.backend} ({sum(p.numel() for p in cached.parameters())} parameters, "
          f"{sum(p.numel() for p in cached.parameters() if p.requires_grad)} trainable)")  # fmt: skip
    print(f"decisions_per_update: {batch.num_decisions * batch.num_envs}")
    print(f"optimizer_steps: {int(metrics['ppo/optimizer_steps'])}")
    print(f"encode_calls_cached: {calls['cached']}")
    print(f"encode_calls_reencode: {calls['reencode']}")
    print(f"update_seconds_cached: {cached_s:.3f}  (runs: {', '.join(f'{s:.3f}' for s in seconds['cached'])})")
    print(f"update_seconds_reencode: {reencode_s:.3f}  (runs: {', '.join(f'{s:.3f}' for s in seconds['reencode'])})")
    print(f"speedup_reencode_over_cached: {reencode_s / cached_s:.2f}")
    print(f"max_weight_difference_after_update: {weight_gap:.3g}")
    print(f"first_minibatch_ratio_dev: {metrics['ppo/first_minibatch_ratio_dev']:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
