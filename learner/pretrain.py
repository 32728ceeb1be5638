"""Behaviour-cloning pre-training of the flow policy from scripted Metaworld demonstrations.

    python -m learner.pretrain --out checkpoints/bc            # defaults from common.config.PretrainConfig
    python -m learner.pretrain --set pretrain.num_demos=7 --out /tmp/bc7

RL fine-tuning starts from a pre-trained policy, and no weights can be downloaded here, so the project
makes its own: the scripted expert is rolled out (with action noise) on `pretrain.num_demos` layouts of
`env.demo_benchmark_seed`, the velocity field is trained with the conditional flow-matching loss, and the
checkpoint (safetensors + config + normalisation statistics as buffers) is evaluated deterministically
on held-out layouts. The default is deliberately weak (few demonstrations) to leave room for RL.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from common.config import RunConfig, load_config
from common.envs import Episode, collect_demonstrations, layouts
from common.policy import MLPFlowPolicy, build_policy, write_directory_atomically
from common.rollout import evaluate_layouts, make_envs, success_interval

REPORT_FILE = "pretrain.json"
# Bump when the BC recipe or the policy's parameter layout changes, so cached checkpoints are rebuilt.
RECIPE_VERSION = 3


def chunk_dataset(episodes: list[Episode], chunk_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(obs_t, actions[t : t + H]) for every step t; chunks running past the episode end repeat its
    last action (the policy learns to hold still once done). Returns (M, obs_dim), (M, H, A)."""
    observations, chunks = [], []
    for episode in episodes:
        length = len(episode.actions)
        index = np.minimum(np.arange(length)[:, None] + np.arange(chunk_size)[None, :], length - 1)
        observations.append(episode.observations)
        chunks.append(episode.actions[index])
    return np.concatenate(observations).astype(np.float32), np.concatenate(chunks).astype(np.float32)


def flow_matching_loss(policy: MLPFlowPolicy, obs: torch.Tensor, chunks: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Conditional flow matching on the straight path a_t = (1 - t) a_0 + t a_1, a_0 ~ N(0, I):
    the velocity at a_t should be a_1 - a_0. Time runs 0 (noise) -> 1 (action) as in common.flow."""
    target = policy.normalize_action(chunks)
    noise = torch.randn(target.shape, generator=generator)
    t = torch.rand(len(obs), generator=generator)
    a_t = (1.0 - t[:, None, None]) * noise + t[:, None, None] * target
    return ((policy.velocity(a_t, t, policy.encode(obs)) - (target - noise)) ** 2).mean()


def pretrain(config: RunConfig, out_dir: str | Path, progress: bool = True) -> dict:
    """Collect demonstrations, train, evaluate, and save a checkpoint to out_dir (written atomically)."""
    cfg, env_cfg = config.pretrain, config.env
    torch.manual_seed(cfg.seed)
    start = time.perf_counter()
    demo_layouts = layouts(env_cfg.task, [env_cfg.demo_benchmark_seed])[: cfg.num_demos]
    episodes = collect_demonstrations(env_cfg.task, demo_layouts, cfg.demo_noise, cfg.seed, env_cfg.max_episode_steps)
    obs_np, chunks_np = chunk_dataset(episodes, config.policy.chunk_size)
    obs, chunks = torch.from_numpy(obs_np), torch.from_numpy(chunks_np)
    demo_seconds = time.perf_counter() - start

    policy = build_policy(config.policy)
    flat_actions = chunks.reshape(-1, config.policy.action_dim)
    policy.set_normalization(obs.mean(0), obs.std(0), flat_actions.mean(0), flat_actions.std(0))
    optimizer = torch.optim.AdamW(policy.velocity_net.parameters(), lr=cfg.lr, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, cfg.train_steps)
    generator = torch.Generator().manual_seed(cfg.seed)
    losses = []
    policy.train()
    bar = tqdm(range(cfg.train_steps), desc="bc flow-matching", disable=not progress, mininterval=1.0)
    for step in bar:
        index = torch.randint(len(obs), (min(cfg.batch_size, len(obs)),), generator=generator)
        loss = flow_matching_loss(policy, obs[index], chunks[index], generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % 100 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-100:]):.4f}")
    policy.eval()
    train_seconds = time.perf_counter() - start - demo_seconds

    eval_layouts = layouts(env_cfg.task, env_cfg.eval_benchmark_seeds)[: cfg.eval_episodes]
    successes = evaluate_layouts(policy, make_envs(env_cfg, 10), eval_layouts) if eval_layouts else np.zeros(0, bool)
    rate, low, high = success_interval(successes)
    report = {
        "demos": len(episodes),
        "demo_success_rate": float(np.mean([e.success for e in episodes])),
        "samples": len(obs),
        "loss_first_100": float(np.mean(losses[:100])),
        "loss_last_100": float(np.mean(losses[-100:])),
        "eval_episodes": len(successes),
        "eval_success_rate": rate,
        "eval_success_95ci": [low, high],
        "eval_layouts": f"{env_cfg.task} benchmark seeds {env_cfg.eval_benchmark_seeds}, first {len(successes)}",
        "seconds": {"demos": demo_seconds, "train": train_seconds, "total": time.perf_counter() - start},
        "config": {"policy": dataclasses.asdict(config.policy), "env": dataclasses.asdict(env_cfg), "pretrain": dataclasses.asdict(cfg)},
    }

    def write(directory: Path) -> None:
        policy.save_pretrained(directory)
        (directory / REPORT_FILE).write_text(json.dumps(report, indent=2))

    write_directory_atomically(out_dir, write)
    return report


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flowrl" / "bc"


def bc_cache_key(config: RunConfig) -> str:
    """The checkpoint depends on the policy's architecture, the task's episode rules and the pre-training
    recipe; not on the sampling fields (noise bounds, K, ...), which the RL run sets on load."""
    relevant = {name: dataclasses.asdict(getattr(config, name)) for name in ("policy", "env", "pretrain")}
    for name in config.policy.SAMPLING_FIELDS:
        del relevant["policy"][name]
    relevant["recipe_version"] = RECIPE_VERSION
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


def ensure_bc_checkpoint(config: RunConfig) -> Path:
    """The cached BC checkpoint for this config, created on first use (so the main job is one command)."""
    path = cache_root() / bc_cache_key(config)
    if (path / REPORT_FILE).is_file():
        return path
    print(f"[pretrain] no cached BC checkpoint for this config: building {path} (once; a few minutes)", flush=True)
    report = pretrain(config, path)
    print(f"[pretrain] done: held-out success {report['eval_success_rate']:.2f} in {report['seconds']['total']:.0f}s", flush=True)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML run config (its env/policy/pretrain sections are used)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="override a config field")
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    args = parser.parse_args(argv)
    config = load_config(args.config, args.set)
    report = pretrain(config, args.out)
    print(json.dumps({k: v for k, v in report.items() if k != "config"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
