"""Learner checkpoints: one directory per save, written atomically, from which a run resumes where it stopped.

A checkpoint directory holds the policy (FlowPolicy.save_pretrained: what actors, replay and a new run load),
trainer_state.pt (TrainerState: the optimiser, the counters, the weight versions still in flight) and, when
algorithm.kl_beta > 0, reference/ (the frozen KL reference, so that a resumed run keeps its starting weights as reference).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from common.policy import CheckpointError, FlowPolicy, write_directory_atomically

TRAINER_STATE_FILE = "trainer_state.pt"
REFERENCE_DIR = "reference"  # inside a checkpoint: the KL reference policy (save_pretrained), when kl_beta > 0


@dataclass
class TrainerState:
    """Everything of a learner's besides its policy that a resume needs (trainer_state.pt). The defaults stand in for
    fields that checkpoints written before them lack."""

    optimizer: dict[str, Any]  # the optimiser's state_dict
    iteration: int  # completed updates
    version: int  # weight version
    env_steps: int  # env steps of every rollout trained on
    config_fingerprint: str  # RunConfig.fingerprint() of the run that wrote it
    skipped_updates: int = 0  # non-finite updates rolled back
    lr_backoff: float = 1.0  # learning-rate multiplier after runs of non-finite updates
    sampling_versions: dict[int, int] = field(default_factory=dict)  # WeightVersions.sampling_versions
    published: dict[int, dict[str, Tensor]] = field(default_factory=dict)  # WeightVersions.published
    demo_tasks: dict[str, int] = field(default_factory=dict)  # DemonstrationTerm.from_iteration


class LearnerCheckpoint:
    """One learner checkpoint directory: `save` writes it whole or not at all, `trainer_state` and `load_reference`
    read it back (the policy itself is read with FlowPolicy.from_pretrained)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)

    def save(
        self, policy: FlowPolicy, state: TrainerState, reference: FlowPolicy | None, policy_state: dict[str, Tensor] | None = None
    ) -> Path:
        """Policy, trainer state and the KL reference (when there is one), written to a temp dir then renamed.
        `policy_state`: the policy's tensors to write in place of its state_dict (FlowPolicy.save_pretrained)."""
        saved = {f.name: getattr(state, f.name) for f in fields(state)}

        def write(tmp: Path) -> None:
            policy.save_pretrained(tmp, policy_state)
            torch.save(saved, tmp / TRAINER_STATE_FILE)
            if reference is not None:  # a resumed run must keep the starting weights as its reference
                reference.save_pretrained(tmp / REFERENCE_DIR)

        return write_directory_atomically(self.directory, write)

    def trainer_state(self) -> TrainerState:
        saved = torch.load(self.directory / TRAINER_STATE_FILE, weights_only=True)  # never plain pickle for files from disk
        known = {f.name for f in fields(TrainerState)}
        state = TrainerState(**{name: value for name, value in saved.items() if name in known})
        return replace(
            state,
            iteration=int(state.iteration),
            version=int(state.version),
            env_steps=int(state.env_steps),
            skipped_updates=int(state.skipped_updates),
            lr_backoff=float(state.lr_backoff),
            sampling_versions={int(n): int(v) for n, v in state.sampling_versions.items()},
            published={int(v): tensors for v, tensors in state.published.items()},
            demo_tasks={str(task): int(start) for task, start in state.demo_tasks.items()},
        )

    def load_reference(self, reference: FlowPolicy, sampling_overrides: dict[str, Any]) -> None:
        """The saved KL reference's weights into `reference` (a frozen copy, keeping what it shares with the policy)."""
        reference_dir = self.directory / REFERENCE_DIR
        if not reference_dir.is_dir():
            raise CheckpointError(
                f"{self.directory} holds no KL reference ({REFERENCE_DIR}/): it was written with algorithm.kl_beta=0, and the "
                "reference must be the run's starting policy; resume with kl_beta=0, or start a new run from this checkpoint"
            )
        saved = FlowPolicy.from_pretrained(reference_dir, **sampling_overrides)
        reference.load_state_dict(saved.state_dict())
