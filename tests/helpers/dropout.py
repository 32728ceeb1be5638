"""Dropout where a run never has it: the failure a policy left in train mode causes (random recomputed log-probs),
provoked on purpose."""

from __future__ import annotations

from torch import nn

from common.policy.mlp import MLPFlowPolicy


def with_dropout(policy: MLPFlowPolicy, p: float) -> MLPFlowPolicy:
    """`policy` with dropout at `p` in every slot of its velocity network (MLP's parameter-free layers): the same
    weights and tensor names, random outputs in train mode."""
    slots = [index for index, layer in enumerate(policy.velocity_net) if type(layer) is nn.Identity]
    assert slots, "the velocity network has no slot for dropout"
    for index in slots:
        policy.velocity_net[index] = nn.Dropout(p)
    return policy
