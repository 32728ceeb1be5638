"""The weight versions a learner keeps for the rollouts still in flight (actors.policy_lag > 0).

With policy_lag = L > 0, iteration m samples with the version published after m - L completed iterations (the first
L + 1 iterations with the starting weights). The store keeps, for the last L + 1 completed-iteration counts, which
version was published then and that version's trainable tensors: the learner scores a lagged rollout's chains with the
weights that sampled it (`weights_of`), and a resumed or restarted learner hands the actors the versions the
uninterrupted run sampled with (`in_flight`), one payload per distinct version (`payload`; LearnerActor puts each in the
object store once). Both maps are saved with checkpoints (learner.files.checkpoints.TrainerState).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from common.policy import FlowPolicy
from common.trajectory import WeightsPayload


class WeightVersions:
    """Published weight versions, kept while a rollout in flight may still come from them. Keeps nothing at policy_lag 0."""

    def __init__(self, policy_lag: int):
        self.policy_lag = policy_lag
        self.sampling_versions: dict[int, int] = {}  # completed-iteration count -> the version published then
        self.published: dict[int, dict[str, Tensor]] = {}  # version -> its trainable tensors

    def record(self, iteration: int, version: int, state: dict[str, Tensor]) -> None:
        """`version`, whose trainable tensors are `state`, is published after `iteration` completed iterations; versions
        no rollout in flight can come from any more are dropped."""
        if self.policy_lag == 0:
            return
        self.sampling_versions[iteration] = version
        self.sampling_versions = {n: v for n, v in self.sampling_versions.items() if n >= iteration - self.policy_lag}
        if version not in self.published:  # a skipped update publishes its version again, unchanged
            self.published[version] = {name: tensor.detach().clone() for name, tensor in state.items()}
        self.published = {v: tensors for v, tensors in self.published.items() if v in self.sampling_versions.values()}

    def restore(self, sampling_versions: dict[int, int], published: dict[int, dict[str, Tensor]]) -> None:
        """The maps a checkpoint saved. At policy_lag 0 there is nothing to restore: the current version samples."""
        if self.policy_lag > 0:
            self.sampling_versions, self.published = dict(sampling_versions), dict(published)

    def in_flight(self, iteration: int, version: int) -> list[int]:
        """The weight versions that sample iterations k, ..., k + policy_lag (k = `iteration`, completed iterations), as the
        uninterrupted run sampled them: at the start of a run the current `version` for all of them; after a resume or
        a learner restart the older ones too, restored from the checkpoint. Call after recording the current version."""
        if self.policy_lag == 0:
            return [version]
        first = min(self.sampling_versions)  # counts before the first one (the run's start) used its version
        return [self.sampling_versions[max(first, iteration + ahead - self.policy_lag)] for ahead in range(self.policy_lag + 1)]

    def payload(self, version: int) -> WeightsPayload:
        """A kept version's payload, for ray.put at once (its arrays view the kept tensors)."""
        return WeightsPayload.from_state(version, self.published[version], copy=False)

    @contextlib.contextmanager
    def weights_of(self, policy: FlowPolicy, version: int, current: int) -> Iterator[FlowPolicy]:
        """`policy` with the trainable tensors of kept `version` in place of its own (those of version `current`),
        restored after."""
        if version not in self.published:
            raise ValueError(
                f"a rollout of weight version {version} reached the learner at version {current}, which keeps versions "
                f"{sorted(self.published)} (actors.policy_lag={self.policy_lag}): the actors ran further behind than the config allows"
            )
        params = dict(policy.named_parameters())
        saved = {name: params[name].detach().clone() for name in self.published[version]}
        with torch.no_grad():
            for name, tensor in self.published[version].items():
                params[name].copy_(tensor)
        try:
            yield policy
        finally:
            with torch.no_grad():
                for name, tensor in saved.items():
                    params[name].copy_(tensor)
