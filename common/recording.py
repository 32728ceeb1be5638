"""Filmed held-out episodes: what the policy does on a layout, as frames, with the outcome evaluation gives it.

An episode is filmed by running it again in an env that renders one more camera after the reset and after every
step (a suite env built with `film`), through evaluate_layouts itself, in the batch evaluation ran it in: a policy's float sums can
depend on the batch size (the MLP's actions differ by about 1e-7 between one env and several on CPU), so the same
batch is what makes the filmed episode the evaluated one, step for step. Rendering reads the simulation and never
writes it. Ray-free: rollout actors, learner.replay and tests use it alike.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.policy import FlowPolicy
from common.rollout import evaluate_layouts
from common.suites import Layout, SuiteEnv
from common.video import caption, write_mp4

VIDEO_SIZE = 256  # pixels per side: the block and the gripper's fingers stay visible


def layout_id(layout: Layout) -> str:
    """<benchmark seed>-<index in that benchmark>: an initial state's name in captions and file names."""
    return f"{layout.benchmark_seed}-{layout.index:02d}"


@dataclass
class EpisodeRecording:
    """One filmed deterministic episode."""

    task: str
    layout: Layout
    success: bool
    steps: int  # env steps the episode ran
    frames: np.ndarray  # (steps, H, W, 3) uint8: the scene after every step

    @property
    def outcome(self) -> str:
        return "success" if self.success else "failure"

    @property
    def layout_id(self) -> str:
        return layout_id(self.layout)

    @property
    def file_name(self) -> str:
        task = self.task.replace("/", "-")  # a gymnasium id's namespace is no directory
        return f"{task}_{self.layout_id}_{self.outcome}_{self.steps}steps.mp4"

    def captioned(self, label: str | None = None) -> np.ndarray:
        """The frames with the task, layout, outcome and a step counter written on them (and `label` above, if given)."""
        head = [label] if label else []
        return caption(
            self.frames,
            [
                [*head, f"{self.task}  layout {self.layout_id}", f"step {t}/{self.steps}  {self.outcome}"]
                for t in range(1, len(self.frames) + 1)
            ],
        )


def filmed_slots(size: int, positions: Sequence[int]) -> list[int]:
    """The env slots (position % size) that the `positions` of an evaluation in groups of `size` envs run in:
    record_layouts needs a filmed env for each of these, and for no other."""
    return sorted({position % size for position in positions})


def record_layouts(
    policy: FlowPolicy,
    envs: list[SuiteEnv],
    filmed: Mapping[int, SuiteEnv],
    layouts: Sequence[Layout],
    positions: Sequence[int] | None = None,
) -> list[EpisodeRecording]:
    """The episodes at `positions` (default: all) of `evaluate_layouts(policy, envs, layouts)`, filmed, in position order.

    evaluate_layouts runs layouts in groups of len(envs); each group holding a filmed position runs again whole,
    with filmed[k] in place of envs[k] for its filmed positions, so every outcome is the one that evaluation gives.
    `filmed` maps each of filmed_slots(len(envs), positions) to an env with the cameras of `envs`."""
    size = len(envs)
    wanted = sorted(set(range(len(layouts)) if positions is None else positions))
    if wanted and not 0 <= wanted[0] <= wanted[-1] < len(layouts):
        raise ValueError(f"positions must be in [0, {len(layouts)}), got {wanted}")
    missing = [k for k in filmed_slots(size, wanted) if k not in filmed]
    if missing:
        raise ValueError(f"no filmed env for slot(s) {missing} of groups of {size}: pass one for each filmed slot")
    recordings = []
    for start in sorted({position - position % size for position in wanted}):
        group = list(layouts[start : start + size])
        slots = [filmed[k] if start + k in wanted else envs[k] for k in range(len(group))]
        successes = evaluate_layouts(policy, slots, group)
        recordings += [
            EpisodeRecording(env.task, layout, bool(success), len(env.frames), np.stack(env.frames))
            for k, (env, layout, success) in enumerate(zip(slots, group, successes))
            if start + k in wanted
        ]
    return recordings


def select_episodes(tasks: Sequence[str], successes: Sequence[bool] | np.ndarray, per_task: int = 2) -> list[int]:
    """Which evaluated episodes to film, as indices in evaluation order: per task, its first success and its first
    failure, then its second of each, and so on (the rest of the commoner outcome last), `per_task` at most."""
    if len(tasks) != len(successes):
        raise ValueError(f"{len(tasks)} tasks for {len(successes)} outcomes")
    chosen: list[int] = []
    for task in dict.fromkeys(tasks):
        own = [i for i, name in enumerate(tasks) if name == task]
        wins, losses = [i for i in own if successes[i]], [i for i in own if not successes[i]]
        alternating = [i for pair in itertools.zip_longest(wins, losses) for i in pair if i is not None]
        chosen += alternating[:per_task]
    return sorted(chosen)


def recording_calls(shares: dict[int, np.ndarray], chosen: Sequence[int]) -> list[tuple[int, list[int], list[int]]]:
    """How to film evaluated episodes in the batches they were evaluated in: shares maps each actor to the indices of
    the layouts its evaluate() call was given, in order; returns (actor, that share, positions in it of the `chosen`
    indices) for every share holding one, to pass as record_episodes(weights, [layouts[i] for i in share], size,
    positions). Any actor with the same actors.envs_per_actor films them the same."""
    calls, wanted = [], set(chosen)
    for actor, share in sorted(shares.items()):
        share = [int(i) for i in share]
        positions = [k for k, index in enumerate(share) if index in wanted]
        if positions:
            calls.append((actor, share, positions))
    return calls


def save_evaluation_videos(run_dir: str | Path, iteration: int, recordings: Sequence[EpisodeRecording]) -> list[Path]:
    """Write each recording, captioned, to run_dir/videos/iter_XXXXXX/<task>_<layout>_<success|failure>_<N>steps.mp4;
    returns the paths in the recordings' order."""
    directory = Path(run_dir) / "videos" / f"iter_{iteration:06d}"
    return [write_mp4(directory / recording.file_name, recording.captioned()) for recording in recordings]
