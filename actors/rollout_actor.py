"""RolloutActor: owns environments and a policy copy in eval mode; samples chains, returns typed rollouts.

Plain Python, so it can be tested without Ray; learner.main turns it into a Ray actor with
`ray.remote(num_cpus=..., num_gpus=...)`. It only reads weights (a WeightsPayload published once per
version by the learner through one `ray.put`) and never writes into them.

Every rollout is a pure function of (weights, seed, iteration, actor index): the envs are reset at the
start of each call with a seed derived from those three numbers and the sampling noise comes from a
generator seeded the same way. Episodes still running when the call ends are cut and bootstrapped
(the record's bootstrap observations and the learner's critic), so resuming from a checkpoint at iteration k reproduces the
uninterrupted run exactly.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from common.config import RunConfig
from common.decision_graph import DecisionGraph
from common.file_digests import trust_digests
from common.flow import compile_steps
from common.policy import FlowPolicy
from common.recording import VIDEO_SIZE, EpisodeRecording, filmed_slots, record_layouts
from common.rollout import (
    GroupVectorEnv,
    camera_configs,
    close_and_free,
    collect_rollout,
    env_tasks,
    evaluate_layouts,
    make_envs,
    run_group_tasks,
    task_positions,
)
from common.suites import ImageConfig, Layout, make_suite
from common.trajectory import RolloutBatch, WeightsPayload
from common.vector_env import ChunkedVectorEnv

if TYPE_CHECKING:
    from actors.run_files import RunFiles


def rollout_seed(seed: int, iteration: int, actor_index: int) -> int:
    """A 63-bit seed that differs for every (run seed, iteration, actor)."""
    return int(np.random.SeedSequence([seed, iteration, actor_index]).generate_state(2, np.uint64)[0] >> np.uint64(1))


class RolloutActor:
    def __init__(
        self,
        config: RunConfig,
        actor_index: int,
        checkpoint_dir: str | Path,
        benchmark_tables: dict | str | None = None,
        niceness: int | None = None,
        known_digests: dict | None = None,
        files: RunFiles | None = None,
    ):
        """benchmark_tables: the run's layouts, built once outside the actor (Suite.layout_tables): a dict, or the name
        of the run's learner.runtime.startup.LayoutTables actor, whose tables the driver's start-up tasks may still be building,
        read only once the policy is loaded, just before the envs need them; None: the actor builds each benchmark seed
        it needs itself (50 simulated resets each). niceness: the process's scheduling niceness from now on, if higher than it is
        (learner.runtime.startup.ACTOR_NICENESS for the run's actors; None, as in a process that only hosts one: unchanged).
        known_digests: the driver's file digests (common.file_digests.known_digests), so that the checkpoint's
        checksums, verified by the driver, are not hashed again where its files are unchanged. files: where the run's
        files are (actors.run_files): an actor on another node reads `checkpoint_dir` from there; None: here."""
        if niceness is not None:
            os.setpriority(os.PRIO_PROCESS, 0, max(niceness, os.getpriority(os.PRIO_PROCESS, 0)))
        trust_digests(known_digests)
        torch.set_num_threads(1)  # many actors share the node's cores; one thread each avoids oversubscription
        self.config = config
        self.actor_index = actor_index
        # A GPU slice (num_gpus > 0) makes Ray set CUDA_VISIBLE_DEVICES for this actor; otherwise CPU.
        self.device = torch.device("cuda" if config.actors.num_gpus > 0 and torch.cuda.is_available() else "cpu")
        with files.local_copy(checkpoint_dir) if files else contextlib.nullcontext(checkpoint_dir) as directory:
            self.policy = FlowPolicy.from_pretrained(directory, **config.policy.sampling_overrides()).to(self.device).eval()
        if config.actors.speed.precision == "bfloat16":  # a backbone (SmolVLA's VLM + expert) is stored in bfloat16; see precision()
            self.policy.set_backbone_dtype(torch.bfloat16)
        if config.actors.speed.fused_attention:  # a VLA (RunConfig.validate)
            self.policy.fuse_attention()
        if config.actors.speed.send_image_embeddings:  # a VLA with its vision tower frozen (RunConfig.validate)
            self.policy.send_image_embeddings = True
        if config.actors.speed.compile_steps:
            compile_steps(self.policy, "actors.speed.compile_steps")
        if config.actors.speed.compile_vision:  # a VLA policy (RunConfig.validate)
            self.policy.compile_vision("actors.speed.compile_vision")
        if self.device.type == "cuda" and config.actors.speed.cuda_graphs:  # captured at the first decision
            autocast = torch.bfloat16 if config.actors.speed.precision == "bfloat16" else None
            self.policy.decision_graph = DecisionGraph(self.policy, config.actors.envs_per_actor, autocast)
        self.version = -1  # the checkpoint's own weights; any published version replaces them
        # The suite's module first: it sets up what its simulator needs on import (MuJoCo's headless GL backend), and
        # unpickling its tables imports the simulator, which would otherwise fix its GL backend without it.
        self.suite = make_suite(config.env)
        if isinstance(benchmark_tables, str):
            import ray  # only the Ray-hosted actor is handed the tables' actor; the class itself runs without Ray

            benchmark_tables = ray.get(ray.get_actor(benchmark_tables).merged.remote())
        if benchmark_tables:
            self.suite.adopt_layout_tables(benchmark_tables)
        groups, group = run_group_tasks(config, self.suite.tasks())
        tasks = env_tasks(groups, actor_index, config.actors.envs_per_actor, group)
        train_layouts = [layout for task in dict.fromkeys(tasks) for layout in self.suite.layouts(task, config.env.train_benchmark_seeds)]
        # The cameras come from the loaded policy's own config: the checkpoint says what it was trained to see.
        self.cameras = camera_configs(self.policy.config)
        envs = make_envs(self.suite, tasks, self.cameras)
        if config.algorithm.algo == "grpo":  # groups of envs share their layouts: G rollouts of each initial state
            self.vec_env = GroupVectorEnv(envs, train_layouts, config.algorithm.gamma, config.algorithm.group_size)
        else:
            self.vec_env = ChunkedVectorEnv(envs, train_layouts, config.algorithm.gamma)
        self._eval_envs: tuple[str, list] | None = None  # (task, its envs): the last task evaluated

    def eval_envs(self, task: str) -> list:
        """actors.envs_per_actor envs of `task` for held-out episodes: the rollout envs when they all have that task
        (a single-task run), else envs of its own. Only the last task's are kept: an actor of a many-task run would
        otherwise hold envs_per_actor envs of every task (gigabytes for MT10), and building a task's envs again at
        its next evaluation costs far less than its episodes."""
        if all(env.task == task for env in self.vec_env.envs):
            return self.vec_env.envs
        if self._eval_envs is None or self._eval_envs[0] != task:
            self._close_eval_envs()
            self._eval_envs = (task, make_envs(self.suite, [task] * self.config.actors.envs_per_actor, self.cameras))
        return self._eval_envs[1]

    def _close_eval_envs(self) -> None:
        if self._eval_envs is not None:
            close_and_free(self._eval_envs[1])
            self._eval_envs = None

    def load_weights(self, weights: WeightsPayload | None) -> None:
        """Load the call's weight version unless it is the one held. Not only newer ones: a learner restarted from a
        checkpoint publishes versions again that the actors have already moved past, and each call must run with the
        weights it names."""
        if weights is None or weights.version == self.version:
            return
        params = dict(self.policy.named_parameters())
        missing = set(weights.params) - set(params)
        if missing:
            raise KeyError(f"weights version {weights.version} has parameters this policy lacks: {sorted(missing)[:5]}")
        with torch.no_grad(), warnings.catch_warnings():
            # One copy, straight from the object store's read-only arrays into the actor's own tensors: the view is
            # only read (torch warns that it could be written), never kept.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            for name, array in weights.params.items():
                params[name].copy_(torch.from_numpy(array))
        self.version = weights.version

    def precision(self) -> torch.autocast:
        """actors.speed.precision: bfloat16 runs the policy under torch.autocast. Weights stay float32, as broadcast,
        except a backbone's (set_backbone_dtype in __init__): autocast recasts frozen weights at every call."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.config.actors.speed.precision == "bfloat16")

    def sample(self, weights: WeightsPayload | None, iteration: int) -> RolloutBatch:
        self.load_weights(weights)
        seed = rollout_seed(self.config.seed, iteration, self.actor_index)
        obs = self.vec_env.reset(seed)
        generator = torch.Generator(device=self.device).manual_seed(seed)
        with self.precision():
            batch, _ = collect_rollout(
                self.policy, self.vec_env, obs, self.config.actors.decisions_per_rollout, generator, self.version, self.actor_index
            )
        return batch

    def sample_with_receipt(self, weights: WeightsPayload | None, iteration: int) -> tuple[dict[str, int], RolloutBatch]:
        """sample() as two Ray results: a small receipt, which the driver fetches to learn that the call succeeded,
        and the batch, which goes from the object store straight to the learner."""
        batch = self.sample(weights, iteration)
        return {"env_steps": batch.env_steps, "pid": os.getpid()}, batch

    def evaluate(
        self, weights: WeightsPayload | None, eval_layouts: Sequence[Layout], noise_seed: int | None = None
    ) -> tuple[int, np.ndarray]:
        """Deterministic episodes on the given layouts, task by task (common.rollout.evaluate_layouts); returns (weight
        version used, successes). With noise_seed, episodes of the noisy policy the rollouts sample, its noise drawn
        from a generator with that seed."""
        self.load_weights(weights)
        successes = np.zeros(len(eval_layouts), dtype=bool)
        noise = None if noise_seed is None else torch.Generator(device=self.device).manual_seed(noise_seed)
        with self.precision():
            for task, positions in task_positions(eval_layouts).items():
                successes[positions] = evaluate_layouts(self.policy, self.eval_envs(task), [eval_layouts[i] for i in positions], noise)
        return self.version, successes

    def record_episodes(
        self,
        weights: WeightsPayload | None,
        eval_layouts: Sequence[Layout],
        size: int = VIDEO_SIZE,
        positions: Sequence[int] | None = None,
        camera: str | None = None,
    ) -> list[EpisodeRecording]:
        """Film the episodes at `positions` (default: all) of evaluate(weights, eval_layouts): size x size frames from
        `camera` (default: the suite's film_camera), and each outcome as evaluate() gives it (common.recording.
        record_layouts: the batches evaluate() ran are run again). To film episodes of a run's evaluation, pass the
        layouts of one evaluate() call as it was given them (common.recording.recording_calls)."""
        self.load_weights(weights)
        if not eval_layouts or (positions is not None and not len(positions)):
            return []
        film = ImageConfig(size, size, camera or self.suite.film_camera)
        wanted = set(range(len(eval_layouts)) if positions is None else positions)
        if not 0 <= min(wanted) <= max(wanted) < len(eval_layouts):
            raise ValueError(f"positions must be in [0, {len(eval_layouts)}), got {sorted(wanted)}")
        recordings: dict[int, EpisodeRecording] = {}
        with self.precision():
            for task, share in task_positions(eval_layouts).items():
                chosen = [k for k, position in enumerate(share) if position in wanted]
                if not chosen:
                    continue
                envs = self.eval_envs(task)
                # Only the slots that run a chosen episode film: a render context each, of envs_per_actor slots.
                filmed = {k: self.suite.make_env(task, self.cameras, eval_layouts[share[0]], film) for k in filmed_slots(len(envs), chosen)}
                try:
                    taken = record_layouts(self.policy, envs, filmed, [eval_layouts[i] for i in share], chosen)
                finally:
                    close_and_free(filmed)
                recordings |= {share[k]: recording for k, recording in zip(chosen, taken, strict=True)}
        return [recordings[position] for position in sorted(recordings)]

    def close(self) -> None:
        """Free the envs' simulations and render contexts (a process that hosts the actor and goes on)."""
        self.vec_env.close()
        self._close_eval_envs()

    def pid(self) -> int:
        return os.getpid()
