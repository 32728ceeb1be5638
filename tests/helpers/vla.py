"""Tiny lerobot VLAs built offline (CPU, no network) and random observations of them: SmolVLA on either supported
lerobot line, pi0 and pi0.5 on lerobot 0.6."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common.config import PolicyConfig
from common.observation import Observation
from common.policy import FlowPolicy, build_policy
from common.policy.pi0.config import Pi0Config
from common.policy.smolvla.config import SmolVLAConfig
from tests.conftest import REPO

IMAGE_SIZE = 32
PI_TYPES = ["pi0", "pi05"]
INSTRUCTIONS = ["pick up the puck and place it at the goal", "push the block"]
SMOLVLA_TINY_CONFIG = REPO / "configs" / "smolvla_tiny_pick.yaml"
# A tiny VLA run's budget, over tests.conftest.TINY_RUN: one env per actor, four decisions, BC on one demonstration.
TINY_VLA_RUN = {"pretrain.num_demos": 1, "pretrain.train_steps": 8, "pretrain.batch_size": 16, "actors.envs_per_actor": 1,
                "actors.decisions_per_rollout": 4, "env.max_episode_steps": 20, "algorithm.minibatch_size": 4, "algorithm.update_epochs": 1,
                "iterations": 1, "eval_episodes": 2}  # fmt: skip


def smolvla_config(**overrides) -> PolicyConfig:
    """The tiny SmolVLA: 2 VLM layers, 32x32 frames, Metaworld's 39-d state and 4-d actions unpadded."""
    smolvla = SmolVLAConfig(**{"num_vlm_layers": 2, "max_state_dim": 39, "max_action_dim": 4, **overrides.pop("smolvla", {})})
    base = dict(type="smolvla", image_size=IMAGE_SIZE, chunk_size=4, num_steps=3, hidden_dim=32, smolvla=smolvla)
    return PolicyConfig(**{**base, **overrides})


def tiny_smolvla(seed: int = 0, **overrides) -> FlowPolicy:
    torch.manual_seed(seed)
    return with_test_normalization(build_policy(smolvla_config(**overrides)))


def pi_config(policy_type: str = "pi0", **overrides) -> PolicyConfig:
    """The tiny pi0 / pi0.5: two-layer Gemmas (64 and 32 wide), a one-layer SigLIP at 32 px, 39-d state, 4-d actions."""
    pi0 = Pi0Config(**{
        "paligemma_variant": "tiny", "action_expert_variant": "tiny_expert", "image_resolution": IMAGE_SIZE, "max_state_dim": 39,
        "max_action_dim": 4, "tokenizer_max_length": 48 if policy_type == "pi0" else 240, **overrides.pop("pi0", {}),
    })  # fmt: skip
    base = dict(type=policy_type, image_size=IMAGE_SIZE, chunk_size=4, num_steps=3, hidden_dim=32, pi0=pi0)
    return PolicyConfig(**{**base, **overrides})


def tiny_pi(policy_type: str = "pi0", seed: int = 0, **overrides) -> FlowPolicy:
    torch.manual_seed(seed)
    policy = build_policy(pi_config(policy_type, **overrides))
    # lerobot starts pi0.5's adaRMS layers at zero, so the time would reach nothing; a trained model's are not zero.
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "layernorm.dense." in name or "norm.dense." in name:
                parameter.normal_(0.0, 0.05)
    return with_test_normalization(policy)


def with_test_normalization(policy: FlowPolicy) -> FlowPolicy:
    """Non-trivial normalisation, so a test that ignored it would fail."""
    policy.set_normalization(
        torch.linspace(-0.5, 0.5, 39), torch.full((39,), 0.3), torch.tensor([0.1, -0.2, 0.0, 0.3]), torch.full((4,), 0.5)
    )
    return policy


def tiny_observations(policy: FlowPolicy, batch: int, seed: int = 0) -> Observation:
    """`batch` random observations for a tiny VLA: 39-d states, uint8 frames of every camera at policy.image_size, and
    the INSTRUCTIONS in turn, tokenized by the policy."""
    generator = torch.Generator().manual_seed(seed)
    tokens, mask = policy.tokenize([INSTRUCTIONS[i % len(INSTRUCTIONS)] for i in range(batch)])
    size, cameras = policy.config.image_size, len(policy.config.cameras)
    return Observation(
        state=torch.randn(batch, 39, generator=generator),
        images=torch.randint(0, 256, (batch, cameras, size, size, 3), dtype=torch.uint8, generator=generator),
        tokens=torch.from_numpy(tokens),
        token_mask=torch.from_numpy(mask),
    )


# ATen ops that read a device tensor on the host (or index by a mask's contents, which does): each one stalls the
# CPU until the GPU catches up, and none may run inside a CUDA graph capture.
HOST_READS = {"aten.nonzero.default", "aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.masked_select.default"}


class HostReads(TorchDispatchMode):
    """Records the ops of HOST_READS, and index/index_put with boolean indices (a nonzero inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        indices = args[1] if name.startswith(("aten.index.", "aten.index_put")) and len(args) > 1 else ()
        if name in HOST_READS or any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))
