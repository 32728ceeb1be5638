"""The run configuration's schema: nested dataclasses, one per section, each field documented where it is declared.

`validate()` names the bad field and says how to fix it. Reading YAML files and `--set` overrides into these
dataclasses (unknown keys are errors) lives in common.config_loading. A policy backend's own section lives beside its
model (common.policy.<backend>_config) and is a field of PolicyConfig here.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from common.file_digests import short_digest
from common.policy.pi0.config import Pi0Config
from common.policy.registry import BACKENDS
from common.policy.smolvla.config import SmolVLAConfig
from common.validation import ConfigError as ConfigError  # raised by every section's validate(); imported from here
from common.validation import require, require_choice, require_positive


def cache_dir(kind: str) -> Path:
    """Where the project keeps what it builds once per machine and reuses (BC checkpoints, benchmark layouts, tiny
    local models): $XDG_CACHE_HOME/flowrl/<kind>, ~/.cache/flowrl/<kind> without it."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flowrl" / kind


@dataclass
class PolicyConfig:
    """The flow policy: the fields every backend reads (sizes, the denoising chain, noise bounds, cameras), the MLP
    backend's own architecture (the default backend, whose fields are read at this level), and one section per VLA
    backend, declared beside its model."""

    type: str = "mlp_flow"  # a backend of common.policy.registry.BACKENDS
    # The state and action widths. A config file or --set that leaves them gets the suite's (its state, with a
    # multi-task run's one-hot): common.config_loading.with_suite_sizes.
    obs_dim: int = 39
    action_dim: int = 4  # A
    chunk_size: int = 4  # H: actions per decision, executed whole
    num_steps: int = 4  # K: Euler steps of the denoising chain
    hidden_dim: int = 256  # the MLP's width; a VLA's noise head and critic width
    num_layers: int = 3  # the MLP's velocity network depth
    time_embed_dim: int = 32  # the MLP's sinusoidal time embedding
    # Noise injected at every Euler step, in normalised action units, bounded by a tanh into
    # [log sigma_min^2, log sigma_max^2] (ReinFlow). Bounds are fixed, not learned.
    sigma_min: float = 0.05
    sigma_max: float = 0.15
    # Std of a_0 when sampling stochastically. 0 (RL's default) starts every chain at the prior's mode, where
    # deterministic evaluation also starts: the injected noise alone explores (a_0 has no log-prob term), so improving
    # the stochastic policy moves the evaluated one directly. 1.0 samples a_0 from the flow-matching prior N(0, I).
    init_noise_std: float = 0.0
    # Std of a_0 in deterministic evaluation, whose steps inject no noise. 0: the prior's mode, where RL's default chains
    # start. 1.0: drawn from N(0, I) as lerobot's sampler starts every chain (what lerobot-eval runs), for a policy
    # trained from such starts (init_noise_std 1.0); each evaluation episode's draws are seeded by its layout.
    eval_init_noise_std: float = 0.0
    # How a chain's log-prob is aggregated over its elements: "mean" (per element, ReinFlow; the
    # default: the ratio's sensitivity does not grow with chunk size) or "sum" (the exact joint log-density).
    log_prob_normalization: str = "mean"
    # Camera frames the policy reads: square image_size x image_size RGB from each of `cameras` (Metaworld
    # camera names), rendered once per chunk decision. 0: a state-only policy (the MLP); no frames rendered.
    image_size: int = 0
    cameras: list[str] = field(default_factory=lambda: ["corner"])
    # The lerobot feature each camera's frame is under, in the order of `cameras` (what an export's input_features name
    # and a lerobot checkpoint's are matched by). []: the env's own keys, observation.images.<camera> (env.observations
    # "project") or lerobot's env's (Metaworld: observation.image), renamed by rename_map; filled when the config is read.
    image_keys: list[str] = field(default_factory=list)
    # The env's observation key -> the key the policy reads it under, as lerobot's --rename_map: a checkpoint whose
    # cameras have other names than the suite's (smolvla_base's observation.images.camera1..3) reads the suite's frames,
    # e.g. {observation.images.corner: observation.images.camera1}.
    rename_map: dict[str, str] = field(default_factory=dict)
    # The env units the policy's [-1, 1] actions map onto, element by element: [low_1, ..., low_A, high_1, ..., high_A];
    # []: the env acts in [-1, 1] itself (Metaworld, LIBERO). A config file or --set that leaves it gets the suite's (a
    # gymnasium env's action bounds: PushT's 0 to 512 pixels). lerobot's policies act in the env's units, so a lerobot
    # checkpoint's action statistics are read in these and an export's written in them.
    action_bounds: list[float] = field(default_factory=list)
    smolvla: SmolVLAConfig = field(default_factory=SmolVLAConfig)
    pi0: Pi0Config = field(default_factory=Pi0Config)  # policy.type pi0 and pi05

    def validate(self, path: str = "policy") -> None:
        require_positive(self, path, "obs_dim", "action_dim", "chunk_size", "num_steps", "hidden_dim", "num_layers", "time_embed_dim")
        require(self.image_size >= 0, f"{path}.image_size must be >= 0 (0: no images), got {self.image_size}")
        require(
            self.image_size == 0 or (len(self.cameras) > 0 and len(set(self.cameras)) == len(self.cameras)),
            f"{path}.cameras must list distinct camera names (e.g. [corner]) when image_size > 0, got {self.cameras}",
        )
        require(
            0.0 < self.sigma_min <= self.sigma_max,
            f"{path}.sigma_min/sigma_max must satisfy 0 < sigma_min <= sigma_max, got {self.sigma_min}, {self.sigma_max}",
        )
        require(self.init_noise_std >= 0.0, f"{path}.init_noise_std must be >= 0, got {self.init_noise_std}")
        require(
            self.eval_init_noise_std == 0.0 or (self.eval_init_noise_std > 0.0 and self.init_noise_std > 0.0),
            f"{path}.eval_init_noise_std must be 0, or > 0 with {path}.init_noise_std > 0 (evaluated from random starts, the policy "
            f"is trained from them), got {self.eval_init_noise_std} with init_noise_std {self.init_noise_std}",
        )
        require(
            not self.image_keys or (len(self.image_keys) == len(self.cameras) and len(set(self.image_keys)) == len(self.image_keys)),
            f"{path}.image_keys must be empty or name one distinct key per camera of {path}.cameras {self.cameras}, got {self.image_keys}",
        )
        bad_keys = [key for key in [*self.image_keys, *self.rename_map, *self.rename_map.values()] if not key.startswith("observation.")]
        require(
            not bad_keys,
            f"{path}.image_keys and {path}.rename_map name lerobot observation keys (observation.image, "
            f"observation.images.<name>), got {bad_keys}",
        )
        require_choice(self, path, "log_prob_normalization", ("mean", "sum"))
        bounds, width = self.action_bounds, self.action_dim
        require(
            not bounds or (len(bounds) == 2 * width and all(low < high for low, high in zip(bounds[:width], bounds[width:]))),
            f"{path}.action_bounds must be empty or {2 * self.action_dim} numbers (action_dim lows, then as many highs, each low "
            f"below its high), got {bounds}",
        )
        require(self.type in BACKENDS, f"{path}.type must be one of {sorted(BACKENDS)}, got {self.type!r}")
        for section in dict.fromkeys(backend.section for backend in BACKENDS.values() if backend.section):
            getattr(self, section).validate(f"{path}.{section}")
        vla = self.vla_section()
        if vla:
            require(self.image_size > 0, f"{path}.image_size must be > 0 for policy.type {self.type} (it reads camera frames), got 0")
            section = getattr(self, vla)
            state_dim = 0 if BACKENDS[self.type].state_in_prompt else self.obs_dim
            require(
                state_dim <= section.max_state_dim and self.action_dim <= section.max_action_dim,
                f"{path}.obs_dim ({self.obs_dim}) / action_dim ({self.action_dim}) must not exceed {path}.{vla}.max_state_dim "
                f"({section.max_state_dim}) / max_action_dim ({section.max_action_dim}): raise those, or use fewer state dims",
            )
        else:  # the MLP
            require(
                self.time_embed_dim % 2 == 0,
                f"{path}.time_embed_dim must be even (the MLP's time embedding: sines and cosines in equal halves), "
                f"got {self.time_embed_dim}",
            )
            require(self.hidden_dim >= 2, f"{path}.hidden_dim must be >= 2 (the MLP's noise network: half as wide), got {self.hidden_dim}")

    # Fields that shape sampling and scoring, not the network: a run's config sets them on whatever
    # checkpoint it loads (the architecture always comes from the checkpoint itself).
    SAMPLING_FIELDS = ("num_steps", "sigma_min", "sigma_max", "init_noise_std", "eval_init_noise_std", "log_prob_normalization")

    def action_units(self) -> tuple[np.ndarray, np.ndarray]:
        """(centre, half width), float32, of each action element's env units (action_bounds): an env action is centre +
        half width * the policy's action in [-1, 1]. (0, 1) per element where action_bounds is empty."""
        if not self.action_bounds:
            return np.zeros(self.action_dim, dtype=np.float32), np.ones(self.action_dim, dtype=np.float32)
        lows, highs = (
            np.asarray(bounds, dtype=np.float64)
            for bounds in (self.action_bounds[: self.action_dim], self.action_bounds[self.action_dim :])
        )
        return ((lows + highs) / 2).astype(np.float32), ((highs - lows) / 2).astype(np.float32)

    def image_features(self) -> list[str]:
        """The lerobot feature of each camera's frame, in the order of `cameras` (image_keys, or
        observation.images.<camera> where it is empty)."""
        return list(self.image_keys) or [f"observation.images.{camera}" for camera in self.cameras]

    def vla_section(self) -> str | None:
        """The subsection policy.type reads ("smolvla", or "pi0" for pi0 and pi0.5), None for the MLP."""
        return BACKENDS[self.type].section

    def sampling_overrides(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.SAMPLING_FIELDS}

    def unused_sections(self) -> list[str]:
        """The backend subsections (policy.<backend>) that policy.type does not read."""
        used = self.vla_section()
        return [f.name for f in dataclasses.fields(self) if dataclasses.is_dataclass(getattr(self, f.name)) and f.name != used]

    @property
    def action_elements(self) -> int:
        """D = H * A, the number of action elements in one chunk."""
        return self.chunk_size * self.action_dim


# actors.policy_lag: beyond a few versions the behaviour weights drift far from the proximal policy, and the
# learner keeps one copy of the trainable tensors per version in flight.
MAX_POLICY_LAG = 2


@dataclass
class GymSuiteConfig:
    """env.gym: any registered gymnasium env id as a suite (env.suite "gym"; common.suites.gym_env), with how its
    observations reach the policy. env.task is the env id, e.g. gym_pusht/PushT-v0."""

    module: str = ""  # imported before gymnasium.make, so that it registers its env ids (e.g. gym_pusht)
    kwargs: dict[str, Any] = field(default_factory=dict)  # gymnasium.make's keyword arguments (e.g. obs_type)
    state_key: str = ""  # "": the observation is the state vector (a Box); else the key of a Dict observation's state
    success_key: str = "is_success"  # the info key that says the task is done
    instruction: str = ""  # the task in words, for language-conditioned policies
    camera: str = "render"  # the name the env's own render() goes by in policy.cameras

    def validate(self, path: str = "env.gym") -> None:
        for name in ("success_key", "camera"):
            require(isinstance(getattr(self, name), str) and getattr(self, name), f"{path}.{name} must be a non-empty string")
        require(isinstance(self.kwargs, dict), f"{path}.kwargs must be a mapping, got {self.kwargs!r}")


OBSERVATION_LAYOUTS = ("auto", "project", "lerobot")

# The windows a task's last stall window is held against (RunConfig.stall_compare, common.metrics.stalled_tasks).
STALL_COMPARISONS = ("first", "first_or_previous")


@dataclass
class EnvConfig:
    """The suite and task, the episode rules, and which initial states each phase may see."""

    suite: str = "metaworld"  # the environment suite (common.suites): metaworld, or gym (any gymnasium env id, env.gym)
    task: str = "pick-place-v3"  # the suite's task, or a task set (MT10, MT50) or comma-separated tasks: one policy on all
    # What the policy observes (docs/lerobot.md). "project": the suite's full state (Metaworld's 39 elements; LIBERO's 8
    # and the goal's object and target, 26) and any of its cameras by name, the project's instructions. "lerobot": what
    # lerobot's own env class of the suite hands a policy: its state elements, its frames under its keys (Metaworld: one
    # observation.image; LIBERO: observation.images.image and .image2), drawn as it draws them, its task sentences and,
    # unless max_episode_steps is given, its episode limit. "auto": "lerobot" when the run starts from a lerobot
    # checkpoint whose input features are that layout's (after policy.rename_map), else "project"; resolved when the
    # config is read.
    observations: str = "auto"
    # How frames are drawn: "fast" (no shadows, reflections or multisampling: about ten times cheaper on a CPU), "default"
    # (the renderer's own settings, which lerobot's env classes keep), or "auto": "default" with env.observations "lerobot",
    # else "fast".
    render: str = "auto"
    max_episode_steps: int = 200  # at most the suite's own limit (Metaworld: 500)
    stop_on_success: bool = True  # an episode ends at its first success (else it runs to max_episode_steps)
    # "success": 1 when the task first succeeds; "dense": the suite's own (Metaworld's shaped) reward; "shaped": success
    # plus potential-based shaping (common.vector_env) from the suite's measure of progress (Metaworld: its dense reward;
    # LIBERO: a pick and place's reach, lift and carry), which pays progress toward success without changing which
    # policy is best.
    reward: str = "success"
    # Initial states ("layouts") are fixed by a seed and an index (Metaworld: its benchmark seed, 50 layouts per seed).
    # Keep the three sets disjoint: demonstrations, RL training and held-out evaluation.
    demo_benchmark_seed: int = 0
    # Ten seeds (500 layouts) for training: with few layouts the policy can fit them and stop generalising to held-out ones.
    train_benchmark_seeds: list[int] = field(default_factory=lambda: [2, 3, 4, 5, 7, 8, 9, 10, 11, 12])
    eval_benchmark_seeds: list[int] = field(default_factory=lambda: [1, 6])  # the held-out layouts every evaluation scores
    # A multi-task run's rollout envs per task: each task's weight against a task not named here (1.0); the run's envs
    # (GRPO groups) are dealt out in proportion, at least one each, the tasks interleaved (common.rollout.group_tasks).
    task_weights: dict[str, float] = field(default_factory=dict)
    # The weight of a task the starting policy already solves: its BC held-out success (the checkpoint's pretrain.json)
    # above pretrain.target_success_max, where RL has little left to gain; task_weights overrides it. 1.0: an even share.
    solved_task_weight: float = 1.0
    gym: GymSuiteConfig = field(default_factory=GymSuiteConfig)

    def validate(self, path: str = "env") -> None:
        require(isinstance(self.suite, str) and self.suite, f"{path}.suite must name a suite (common.suites), got {self.suite!r}")
        require_choice(self, path, "observations", OBSERVATION_LAYOUTS)
        require_choice(self, path, "render", ("auto", "fast", "default"))
        require_positive(self, path, "max_episode_steps")
        require_choice(self, path, "reward", ("success", "dense", "shaped"))
        require(self.demo_benchmark_seed >= 0, f"{path}.demo_benchmark_seed must be >= 0, got {self.demo_benchmark_seed}")
        for name in ("train_benchmark_seeds", "eval_benchmark_seeds"):
            seeds = getattr(self, name)
            require(len(seeds) > 0, f"{path}.{name} must not be empty")
            require(min(seeds) >= 0 and len(set(seeds)) == len(seeds), f"{path}.{name} must be distinct seeds >= 0, got {seeds}")
        bad_weights = {task: weight for task, weight in self.task_weights.items() if not weight > 0}
        require(not bad_weights, f"{path}.task_weights must be > 0, got {bad_weights}")
        require(self.solved_task_weight > 0, f"{path}.solved_task_weight must be > 0, got {self.solved_task_weight}")
        overlap = (set(self.train_benchmark_seeds) | {self.demo_benchmark_seed}) & set(self.eval_benchmark_seeds)
        require(
            not overlap,
            f"{path}.eval_benchmark_seeds {sorted(overlap)} also used for training or demonstrations: "
            "held-out evaluation needs layouts never trained on",
        )
        if self.suite == "gym":
            self.gym.validate(f"{path}.gym")

    def unused_sections(self) -> list[str]:
        """The subsections of the suites this run does not use (the banner leaves them out)."""
        return [] if self.suite == "gym" else ["gym"]

    @property
    def lerobot_observations(self) -> bool:
        """The policy observes what lerobot's env class of the suite gives (env.observations "lerobot")."""
        return self.observations == "lerobot"

    @property
    def fast_render(self) -> bool:
        """Frames are drawn without shadows, reflections and multisampling (env.render, "auto" resolved)."""
        return self.render == "fast" or (self.render == "auto" and not self.lerobot_observations)


@dataclass
class SpeedConfig:
    """What the actors' decisions and the learner's update share of how they run (actors.speed, learner.speed). None
    changes what is computed beyond float rounding."""

    # "float32", or "bfloat16" (torch.autocast over float32 weights). Actors: the learner stays float32 and warns when
    # the behaviour log-probs drift (learner.behaviour_gap_warn). Learner (for a GPU): the ratio check compares the
    # learner with itself, so it holds in either; in bfloat16 it also scores a few chains in float32 every iteration
    # (logprob/precision_gap_max, and a PrecisionGapWarning when rounding alone moves the log-probs by half the clip
    # range or more).
    precision: str = "float32"
    # Each denoising step runs as one torch.compile graph (common.flow.compile_steps): a step's elementwise work fused
    # into far fewer kernels, for code bound by its launches. Actors: inside the CUDA graph where there is one, compiled
    # at the first decision of each shape (tens of seconds). Learner: forward and backward, one graph per step (or per
    # one-pass batch), compiled at the first update (and again for a new batch size, grad or autocast mode); old and new
    # log-probs are scored by the same compiled step, so the ratio check holds.
    compile_steps: bool = False
    # A VLA's vision tower runs as one torch.compile graph (VLAFlowPolicy.compile_vision): its layer norms, activations
    # and residual sums fused into fewer kernels; the same features as eager up to float rounding. Actors: every camera's
    # frames, one batch per decision, inside the CUDA graph where there is one. Learner: the scoring pass's encodes and
    # each micro-batch's where the encoder trains; old and new log-probs read the same features.
    compile_vision: bool = False
    # A VLA's prefix pass and denoising steps attend through torch's scaled_dot_product_attention in place of the
    # eager attention lerobot runs (fuse_attention: SmolVLAFlowPolicy, PiFlowPolicy), which copies keys and values per
    # query head and holds every (query, key) score as float32 (for the backward pass too, at every layer and step, in
    # the learner): the same attention up to float rounding, without those.
    fused_attention: bool = False

    def validate(self, path: str) -> None:
        require_choice(self, path, "precision", ("float32", "bfloat16"))


@dataclass
class ActorSpeedConfig(SpeedConfig):
    """How the actors' decisions run: their arithmetic and graphs. None changes what a policy samples beyond float
    rounding (and, with CUDA graphs, which noise it draws)."""

    # On a CUDA device, each chunk decision is one CUDA graph replay (common.decision_graph): the same policy, its
    # noise drawn in one call per decision, so a run samples other (equally reproducible) noise than without graphs.
    # No effect on CPU.
    cuda_graphs: bool = True
    # A VLA actor records each decision's vision-tower tokens (every camera's, lerobot's embed_image, as float32) in
    # place of its frames, and the learner's encodes read them instead of running the tower over the iteration's frames
    # again (the observations a chunk led to, which no decision read, keep their frames). Needs the vision tower frozen
    # (policy.<section>.train_vlm: false). The learner then scores on the actors' tower arithmetic (bfloat16 in a
    # bfloat16 actor), as the actors sampled.
    send_image_embeddings: bool = False

    def validate(self, path: str = "actors.speed") -> None:
        super().validate(path)


@dataclass
class ActorFaultsConfig:
    """What happens when a rollout actor dies or wedges."""

    max_restarts: int = 3  # per actor: a dead or wedged actor is restarted and its call retried this many times
    # Seconds one rollout, or one group of held-out episodes (envs_per_actor of a task, run together), may take before
    # its actor counts as wedged: it is killed, restarted and the call retried. An evaluate call gets it once per
    # group its share holds. A restarted actor's start-up gets as long again, apart from the retried call (a SmolVLA
    # actor on CPU needs minutes per rollout: raise it there).
    call_timeout_s: float = 900.0
    # Actors whose restarts are exhausted are dropped with a warning; below this many the run stops.
    min_alive: int = 1

    def validate(self, path: str = "actors.faults") -> None:
        require(self.max_restarts >= 0, f"{path}.max_restarts must be >= 0, got {self.max_restarts}")
        require_positive(self, path, "call_timeout_s", "min_alive")


@dataclass
class ActorsConfig:
    """Rollout actors: how many, their envs, their resources; how their decisions run (speed) and what happens when
    one fails (faults)."""

    num_actors: int = 10  # rollout actors (Ray actors), each with its own envs and copy of the policy
    envs_per_actor: int = 2  # envs each actor steps, one chunk decision for all of them at a time
    decisions_per_rollout: int = 50  # chunk decisions per env per iteration
    num_cpus: float | None = None  # per actor; None: spread the cluster's CPUs evenly over the actors
    num_gpus: float = 0.0  # per actor, fractional "GPU slices" (e.g. 0.1); 0 on CPU machines
    # Custom Ray resources per actor, e.g. {rollout_gpu: 0.1}: pins actors to the node types that declare
    # them (cluster/*.yaml), so placement is decided by config, not code.
    resources: dict[str, float] = field(default_factory=dict)
    # Weight versions the actors may sample behind the learner. 0: synchronous (sample with v, train, publish
    # v+1, sample again). 1 (default): the actors sample iteration i+1 with version v while the learner trains on
    # iteration i, so sampling and update overlap; the learner scores the chains with the behaviour weights it
    # kept and clips as algorithm.stale_rollouts says. Logged as rollout/weight_version_lag. docs/results.md compares
    # the two lags across seeds.
    policy_lag: int = 1
    speed: ActorSpeedConfig = field(default_factory=ActorSpeedConfig)
    faults: ActorFaultsConfig = field(default_factory=ActorFaultsConfig)

    def validate(self, path: str = "actors") -> None:
        require_positive(self, path, "num_actors", "envs_per_actor", "decisions_per_rollout")
        require(self.num_cpus is None or self.num_cpus > 0, f"{path}.num_cpus must be > 0 or null, got {self.num_cpus}")
        _ray_resources(path, self.num_gpus, self.resources)
        require(0 <= self.policy_lag <= MAX_POLICY_LAG, f"{path}.policy_lag must be in [0, {MAX_POLICY_LAG}], got {self.policy_lag}")
        self.speed.validate(f"{path}.speed")
        self.faults.validate(f"{path}.faults")
        min_alive = self.faults.min_alive
        require(min_alive <= self.num_actors, f"{path}.faults.min_alive ({min_alive}) must be <= {path}.num_actors ({self.num_actors})")


@dataclass
class AlgorithmConfig:
    """What the update computes: advantages (GAE or GRPO's groups), the clipped PPO loss, KL to a reference,
    minibatching and the optimiser's schedules. How the learner runs it (resources, restarts) is LearnerConfig's."""

    gamma: float = 0.99  # discount per ENV STEP; a chunk of n executed steps is discounted by gamma**n
    gae_lambda: float = 0.95  # per chunk decision
    clip_eps: float = 0.05  # on the ratio of per-element-mean chain probabilities (see policy.log_prob_normalization)
    value_clip: float | None = None  # None: plain MSE; else clip the new value around the old by this much
    vf_coef: float = 0.5  # the value loss's weight in the total loss
    ent_coef: float = 0.0  # the entropy bonus's weight (the entropy of the chain's injected noise)
    actor_lr: float = 1e-4  # with clip_eps 0.05 (docs/results.md: the recipe and the step sizes tried)
    critic_lr: float = 5e-4  # the critic's learning rate (actor_lr the policy's)
    update_epochs: int = 8  # passes over the iteration's decisions (stopped early above target_kl)
    # Every epoch shuffles the iteration's decisions and splits ALL of them into num_minibatches minibatches whose sizes
    # differ by at most one (one optimiser step each; one per decision when there are fewer decisions). Counting
    # minibatches rather than fixing their size keeps the update valid for any actors.num_actors x envs_per_actor x
    # decisions_per_rollout, leaves no decision out of an epoch, and keeps the steps per iteration fixed when GRPO
    # drops incomplete groups from the batch.
    num_minibatches: int = 2
    # null: the size follows from num_minibatches. A number fixes the size instead (num_minibatches is then unused):
    # ceil(decisions / minibatch_size) minibatches per epoch, evened out, so none exceeds it (a memory bound, with
    # grad_accum) and none is a short leftover.
    minibatch_size: int | None = None
    grad_accum: int = 1  # micro-batches per minibatch, sizes differing by at most one (same gradient, less memory)
    max_grad_norm: float = 1.0  # gradients clipped to this global norm before each optimiser step
    target_kl: float | None = 0.1  # stop the epoch loop when the k3 approx-KL exceeds this; None: never
    lr_warmup_iters: int = 0  # iterations over which both learning rates rise linearly to their full value
    lr_schedule: str = "cosine"  # "cosine" decays to lr_final_frac * lr over the run; "constant"
    lr_final_frac: float = 0.1  # the cosine schedule's last learning rate, as a fraction of the first
    critic_warmup_iters: int = 3  # iterations that train only the critic (the actor's lr is 0)
    normalize_advantages: bool = True  # over the whole batch, once per iteration
    # A multi-task run's advantages normalised task by task: each task's decisions weigh alike in the update, whatever
    # the scale of its rewards and its critic's errors (with normalize_advantages).
    normalize_advantages_per_task: bool = False
    ratio_tolerance: float = 1e-5  # |ratio - 1| allowed on the first minibatch before any update
    # "ppo": advantages from GAE and a critic. "grpo": critic-free; each initial state is rolled out
    # group_size times (envs_per_actor a multiple of it) and every episode's return is compared with its
    # group's (common.rl.grpo_advantages). GRPO trains and broadcasts no critic, skips critic_warmup_iters
    # and normalize_advantages (the group comparison is the normalisation), and masks episodes the rollout cut off.
    algo: str = "ppo"
    group_size: int = 4  # G, rollouts per initial state (grpo)
    grpo_std_normalization: bool = True  # (R - mean) / (std + eps); false: R - mean (Dr. GRPO)
    # KL(policy || reference) per log-prob element, added to the actor loss times kl_beta; the reference is
    # the frozen starting policy. 0: off, and no reference is built. Estimators: common.rl.kl_to_reference.
    kl_beta: float = 0.0
    kl_estimator: str = "exact"  # "exact" (analytic, per transition), "k1", "k2" or "k3"
    # A rollout from an older weight version (actors.policy_lag > 0): "behaviour" clips the ratio to the policy that
    # sampled the chains, so every update stays within clip_eps of it; "decoupled" clips it to the learner's weights
    # before the update and weights each sample by pi_prox / pi_behaviour (Hilton et al. 2021). docs/performance.md
    # compares the two.
    stale_rollouts: str = "behaviour"
    # A task the run names stalled (stall_window) gets this many scripted demonstrations (the first layouts of
    # env.demo_benchmark_seed, with pretrain.demo_noise and pretrain.successful_demos_only), and every later step
    # that trains the actor adds their flow-matching loss, times stall_bc_coef, on batches of stall_bc_batch
    # (learner.update.demonstration_term).
    # 0: a stall is only named.
    stall_demos: int = 0
    stall_bc_coef: float = 1.0
    stall_bc_batch: int = 256

    # Fields only one algorithm reads: the critic's (ppo) and the groups' (grpo).
    CRITIC_FIELDS = (
        "gae_lambda",
        "value_clip",
        "vf_coef",
        "critic_lr",
        "critic_warmup_iters",
        "normalize_advantages",
        "normalize_advantages_per_task",
    )
    GRPO_FIELDS = ("group_size", "grpo_std_normalization")

    def unused_fields(self) -> tuple[str, ...]:
        """The fields `algo` does not read."""
        return self.GRPO_FIELDS if self.algo == "ppo" else self.CRITIC_FIELDS

    def minibatch_sizes(self, decisions: int) -> list[int]:
        """One epoch's minibatch sizes over `decisions` (>= 1) shuffled decisions: they sum to `decisions` (each decision
        enters once) and differ by at most one, the larger first."""
        count = self.num_minibatches if self.minibatch_size is None else math.ceil(decisions / self.minibatch_size)
        count = min(count, decisions)
        size, larger = divmod(decisions, count)
        return [size + 1] * larger + [size] * (count - larger)

    def validate(self, path: str = "algorithm") -> None:
        require(0 < self.gamma <= 1, f"{path}.gamma must be in (0, 1], got {self.gamma}")
        require(0 <= self.gae_lambda <= 1, f"{path}.gae_lambda must be in [0, 1], got {self.gae_lambda}")
        require(0 < self.clip_eps < 1, f"{path}.clip_eps must be in (0, 1), got {self.clip_eps}")
        require(self.value_clip is None or self.value_clip > 0, f"{path}.value_clip must be > 0 or null")
        require_positive(self, path, "update_epochs", "num_minibatches", "grad_accum", "max_grad_norm")
        require(self.minibatch_size is None or self.minibatch_size > 0, f"{path}.minibatch_size must be > 0 or null")
        require(self.actor_lr >= 0 and self.critic_lr >= 0, f"{path}.actor_lr/critic_lr must be >= 0")
        require(self.target_kl is None or self.target_kl > 0, f"{path}.target_kl must be > 0 or null")
        require_choice(self, path, "lr_schedule", ("cosine", "constant"))
        require(0 <= self.lr_final_frac <= 1, f"{path}.lr_final_frac must be in [0, 1]")
        require(self.lr_warmup_iters >= 0 and self.critic_warmup_iters >= 0, f"{path}.lr_warmup_iters/critic_warmup_iters must be >= 0")
        require_choice(self, path, "algo", ("ppo", "grpo"))
        require(self.group_size >= 2, f"{path}.group_size must be >= 2 (a group compares its rollouts), got {self.group_size}")
        require(
            0 <= self.stall_demos <= 50,
            f"{path}.stall_demos must be in [0, 50] (one benchmark seed holds 50 layouts), got {self.stall_demos}",
        )
        require(self.stall_bc_coef > 0, f"{path}.stall_bc_coef must be > 0, got {self.stall_bc_coef}")
        require(self.stall_bc_batch > 0, f"{path}.stall_bc_batch must be > 0, got {self.stall_bc_batch}")
        require(self.kl_beta >= 0, f"{path}.kl_beta must be >= 0 (0: no KL to the reference), got {self.kl_beta}")
        require_choice(self, path, "kl_estimator", ("exact", "k1", "k2", "k3"))
        require_choice(self, path, "stale_rollouts", ("decoupled", "behaviour"))
        require(self.ratio_tolerance > 0, f"{path}.ratio_tolerance must be > 0")
        require(
            not self.normalize_advantages_per_task or self.normalize_advantages,
            f"{path}.normalize_advantages_per_task needs normalize_advantages: true",
        )


@dataclass
class LearnerSpeedConfig(SpeedConfig):
    """How the learner's scoring and update run: arithmetic, passes, compiled graphs, micro-batches. None changes the
    update beyond float rounding."""

    # Keep no activations of the denoising steps for the backward pass: each step's forward runs again there
    # (torch.utils.checkpoint), the same numbers bit for bit. The update's activations shrink to about one step's, at
    # one more forward pass per step: for a VLA learner that does not fit its GPU otherwise (docs/pi0.md).
    recompute_steps: bool = False
    # Score a chain's K denoising steps in one pass over K x B rows (each row's prefix features repeated K times)
    # instead of K passes over B: K times fewer kernel launches, in larger kernels, for a learner bound by its
    # launches, holding K steps' inputs at once. The log-probs differ from the step-by-step ones by float rounding;
    # the learner scores old and new log-probs the same way, so the ratio check holds (common.flow.all_transitions).
    steps_in_one_pass: bool = False
    # Micro-batches sized by memory (a GPU learner), in place of algorithm.grad_accum's fixed split: at its first
    # optimiser step that trains the actor, the learner reads how far its first micro-batch raised the GPU allocator's
    # peak above what was allocated before it, per decision, and from then on splits every minibatch into the fewest
    # micro-batches whose peak that estimate keeps within this many GiB (metric ppo/micro_batch_rows). Fewer,
    # larger micro-batches launch fewer kernels; the update differs from grad_accum's by float rounding only. 0: off.
    micro_batch_memory_gib: float = 0.0

    def validate(self, path: str = "learner.speed") -> None:
        super().validate(path)
        require(
            not (self.recompute_steps and self.steps_in_one_pass),
            f"{path}.recompute_steps and {path}.steps_in_one_pass: choose one (one pass keeps every step's activations at once)",
        )
        require(
            not (self.recompute_steps and self.compile_steps),
            f"{path}.recompute_steps and {path}.compile_steps: choose one (a compiled step keeps the activations its compiler "
            "chose; recomputing runs each step's forward again in the backward pass)",
        )
        require(self.micro_batch_memory_gib >= 0, f"{path}.micro_batch_memory_gib must be >= 0 (0: off), got {self.micro_batch_memory_gib}")


@dataclass
class LearnerFaultsConfig:
    """What the learner does when an update goes wrong (out of memory, non-finite numbers) and when the learner actor
    dies or wedges."""

    # On a GPU out-of-memory error, roll the update back and run it again from its start with each minibatch split into
    # twice as many micro-batches (algorithm.grad_accum x 2), down to one decision per micro-batch; the learner keeps
    # the split for the rest of its life (metric faults/grad_accum). The update it then makes is the one that grad_accum
    # gives. false: the error stops the update.
    split_on_out_of_memory: bool = True
    # A NaN/Inf in an iteration rolls its update back (weights and optimiser) and skips it; after this many
    # skipped iterations in a row, the learning rates are multiplied by nonfinite_lr_backoff.
    nonfinite_backoff_after: int = 3
    nonfinite_lr_backoff: float = 0.5
    # Times the driver restarts a dead or wedged learner actor from the run's last checkpoint before giving up.
    max_restarts: int = 2
    # A learner call (an update, a publication, a checkpoint) unanswered after max(call_timeout_s,
    # call_timeout_update_factor x the slowest update so far) seconds counts as wedged: the learner is killed and
    # restarted as a dead one is. The learner's start-up is not counted. Factor 0: a fixed call_timeout_s.
    call_timeout_s: float = 900.0
    call_timeout_update_factor: float = 10.0

    def validate(self, path: str = "learner.faults") -> None:
        require_positive(self, path, "nonfinite_backoff_after")
        require(0 < self.nonfinite_lr_backoff <= 1, f"{path}.nonfinite_lr_backoff must be in (0, 1], got {self.nonfinite_lr_backoff}")
        require(self.max_restarts >= 0, f"{path}.max_restarts must be >= 0, got {self.max_restarts}")
        require_positive(self, path, "call_timeout_s")
        factor = self.call_timeout_update_factor
        require(factor >= 0, f"{path}.call_timeout_update_factor must be >= 0 (0: a fixed call_timeout_s), got {factor}")


@dataclass
class LearnerConfig:
    """The learner: its Ray resources and ranks, how they hold the policy, the behaviour-gap warning; how its update
    runs (speed) and what it does when the update or the learner fails (faults)."""

    # Ray resources of the learner actor. num_cpus None: a quarter of the cluster's CPUs, at most 0.5
    # (on CPU the update is short next to sampling). On a GPU cluster: num_gpus 1 (a whole GPU) and a
    # custom resource such as {learner_slot: 1} that only the intended node type declares.
    num_cpus: float | None = None
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)
    # Ranks of a data-parallel learner group, each a Ray actor with the resources above (learner.runtime.learner_group): each
    # scores and trains on a share of the iteration's rollouts and the gradients are summed, so the update is the
    # one-rank update up to float rounding. 1: the learner alone.
    num_learners: int = 1
    # How a learner group holds the policy: "none", every rank the whole of it; "fsdp", each rank a 1/num_learners shard
    # of every parameter, its gradient and its Adam state (torch FSDP2, learner.sharding), gathered whole while scoring
    # and one module at a time in the update, for a policy whose training state outgrows one device.
    sharding: str = "none"
    # Warn (BehaviourGapWarning) when the actors' behaviour log-probs differ from the learner's recomputation
    # by more than this on rollouts of the learner's own weights: the sign of actors and learner running
    # different precisions or devices (bf16 actors, fp32 learner). Same units as log_probs. None: never warn.
    behaviour_gap_warn: float | None = 1e-3
    speed: LearnerSpeedConfig = field(default_factory=LearnerSpeedConfig)
    faults: LearnerFaultsConfig = field(default_factory=LearnerFaultsConfig)

    def validate(self, path: str = "learner") -> None:
        require(self.num_cpus is None or self.num_cpus > 0, f"{path}.num_cpus must be > 0 or null, got {self.num_cpus}")
        _ray_resources(path, self.num_gpus, self.resources)
        require_positive(self, path, "num_learners")
        require_choice(self, path, "sharding", ("none", "fsdp"))
        require(
            self.sharding == "none" or self.num_learners > 1,
            f"{path}.sharding={self.sharding} splits the policy over a learner group: it needs {path}.num_learners >= 2",
        )
        for knob in ("compile_steps", "compile_vision"):
            require(
                self.sharding == "none" or not getattr(self.speed, knob),
                f"{path}.sharding=fsdp and {path}.speed.{knob}: choose one (a compiled graph does not run FSDP's gathers of the "
                "shards it reads)",
            )
        require(self.behaviour_gap_warn is None or self.behaviour_gap_warn > 0, f"{path}.behaviour_gap_warn must be > 0 or null")
        self.speed.validate(f"{path}.speed")
        require(
            self.speed.micro_batch_memory_gib == 0 or self.num_gpus > 0,
            f"{path}.speed.micro_batch_memory_gib reads a GPU's allocator: it needs {path}.num_gpus > 0 (or 0: algorithm.grad_accum's "
            "split)",
        )
        self.faults.validate(f"{path}.faults")


@dataclass
class PretrainConfig:
    """Behaviour cloning from scripted demonstrations (the starting point for RL)."""

    # One expert episode per layout of env.demo_benchmark_seed. None: chosen per task so the BC policy's held-out
    # success lands in [target_success_min, target_success_max], leaving room for RL (learner.bc.training.DEMO_LADDER).
    num_demos: int | None = None
    # Demonstrations of named tasks, in place of num_demos for them (a multi-task run, e.g. {reach-v3: 3}). With
    # num_demos null, a multi-task run chooses the count of each task not named here: the fewest that put that
    # task's held-out success in the window (learner.bc.starting_checkpoint.search_task_demos).
    task_demos: dict[str, int] = field(default_factory=dict)
    target_success_min: float = 0.2  # the window num_demos null aims BC's held-out success at: its low end
    target_success_max: float = 0.7  # and its high end
    demo_noise: float = 0.1  # std of Gaussian noise added to the expert's actions
    # Clone only the expert's episodes that succeed: the demonstrations are then the first layouts of
    # env.demo_benchmark_seed on which it succeeds (for algorithm.stall_demos too). false: the first layouts, failed
    # episodes included (each named in a FailedDemonstrationWarning).
    successful_demos_only: bool = False
    # A LeRobotDataset directory to clone instead of the scripted expert's demonstrations (python -m learner.dataset writes
    # one; a user's own local one does too): it must hold what the run's policy observes under its keys (frames at
    # policy.image_size, observation.state) and its action, and only the run's task sentences. "": the expert.
    dataset: str = ""
    train_steps: int = 3000  # AdamW steps of the flow-matching loss (python -m learner.pretrain --train-steps tries several)
    batch_size: int = 256  # (observation, chunk) pairs per step
    lr: float = 1e-3  # AdamW's, decayed by a cosine over train_steps
    eval_episodes: int = 100  # on env.eval_benchmark_seeds' layouts, deterministic sampling
    seed: int = 0  # the demonstrations' noise, the initialisation and the batches

    def validate(self, path: str = "pretrain") -> None:
        require_positive(self, path, "train_steps", "batch_size")
        require(
            self.num_demos is None or 1 <= self.num_demos <= 50,
            f"{path}.num_demos must be in [1, 50] (one benchmark seed holds 50 layouts) or null (chosen per task), got {self.num_demos}",
        )
        for task, count in self.task_demos.items():
            require(1 <= count <= 50, f"{path}.task_demos[{task!r}] must be in [1, 50] (one benchmark seed holds 50 layouts), got {count}")
        require(
            0 <= self.target_success_min < self.target_success_max <= 1,
            f"{path}.target_success_min/max must satisfy 0 <= min < max <= 1, got {self.target_success_min}, {self.target_success_max}",
        )
        require(
            self.num_demos is not None or self.dataset or self.eval_episodes >= 20,
            f"{path}.num_demos null picks the count from held-out success: {path}.eval_episodes must be >= 20 (100 recommended)",
        )
        require(self.demo_noise >= 0, f"{path}.demo_noise must be >= 0")
        require(
            not (self.successful_demos_only and self.dataset),
            f"{path}.successful_demos_only chooses among the scripted expert's episodes, and {path}.dataset's episodes are cloned as "
            f"they are: set {path}.successful_demos_only: false",
        )
        require(self.lr > 0, f"{path}.lr must be > 0")
        require(self.eval_episodes >= 0, f"{path}.eval_episodes must be >= 0")


@dataclass
class RunConfig:
    """One training run: everything `python -m learner.main` needs."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    actors: ActorsConfig = field(default_factory=ActorsConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    seed: int = 0  # the run's seed: the learner's, and with iteration and actor index each rollout's
    iterations: int = 150  # each of actors.num_actors x envs_per_actor x decisions_per_rollout chunks of policy.chunk_size steps
    eval_every: int = 25  # iterations between deterministic held-out evaluations (0: only at start and end)
    eval_episodes: int = 100  # held-out layouts per evaluation
    eval_videos: int = 2  # held-out episodes filmed per task after each evaluation (first success, first failure); 0: none
    checkpoint_every: int = 25  # iterations between checkpoints (and one at the end, on a stop and on a failure)
    # A multi-task run's stall window, in iterations: every this many, a task whose training-layout success over the last
    # window lies inside the 95% interval of its first window's is named on the console ("[stall]") and in the summary
    # (common.metrics.stalled_tasks). 0: not watched.
    stall_window: int = 20
    # What a task's last window is held against: "first", its first window only; "first_or_previous", the window before
    # the last too, so that a task that moved and then stopped is named as well as one that never moved.
    stall_compare: str = "first"
    # Checkpoints kept in run_dir/checkpoints, the newest (0: every one). An older one is deleted once a newer one is
    # complete and `latest` names it; 2 or more leave --resume a fallback if the newest is found corrupt.
    keep_checkpoints: int = 0
    run_dir: str = "runs/default"
    # Policy to fine-tune: a directory written by save_pretrained. None: the cached BC checkpoint built
    # from `pretrain` (created on first use).
    init_checkpoint: str | None = None
    allow_random_init: bool = False  # fine-tune a randomly initialised policy (almost always a mistake)
    wandb_project: str = "flowrl"  # wandb's project (offline unless WANDB_MODE says otherwise)

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                value.validate(f.name)
        require_positive(self, "", "iterations", "eval_episodes", "checkpoint_every")
        require(self.eval_every >= 0, f"eval_every must be >= 0, got {self.eval_every}")
        require(self.stall_window >= 0, f"stall_window must be >= 0 (0: not watched), got {self.stall_window}")
        require(self.stall_compare in STALL_COMPARISONS, f"stall_compare must be one of {STALL_COMPARISONS}, got {self.stall_compare!r}")
        require(
            not self.algorithm.stall_demos or self.stall_window,
            "algorithm.stall_demos acts on the tasks stall_window names: set stall_window > 0, or algorithm.stall_demos: 0",
        )
        require(self.keep_checkpoints >= 0, f"keep_checkpoints must be >= 0 (0: keep every one), got {self.keep_checkpoints}")
        require(self.eval_videos >= 0, f"eval_videos must be >= 0 (0: no videos), got {self.eval_videos}")
        require(self.seed >= 0, f"seed must be >= 0, got {self.seed}")
        require(bool(self.run_dir.strip()), "run_dir must not be empty (it would write into the current directory): pass --run-dir DIR")
        algorithm = self.algorithm
        for name in ("lr_warmup_iters", "critic_warmup_iters") if algorithm.algo == "ppo" else ("lr_warmup_iters",):  # GRPO: no critic
            warmup = getattr(algorithm, name)
            require(
                warmup < self.iterations,
                f"algorithm.{name} ({warmup}) must be < iterations ({self.iterations}): the run would only warm up",
            )
        decisions = self.actors.num_actors * self.actors.envs_per_actor * self.actors.decisions_per_rollout
        require(
            algorithm.minibatch_size is None or algorithm.minibatch_size <= decisions,
            f"algorithm.minibatch_size ({algorithm.minibatch_size}) exceeds the decisions of one rollout ({decisions} = actors.num_actors "
            "x actors.envs_per_actor x actors.decisions_per_rollout): lower it, or sample more",
        )
        require(
            decisions >= 2,
            "one rollout holds a single decision (actors.num_actors x actors.envs_per_actor x actors.decisions_per_rollout = 1): "
            "an advantage normalised over one decision is 0 and the critic's explained variance is undefined: sample at least 2",
        )
        smallest = min(algorithm.minibatch_sizes(decisions))
        require(
            algorithm.grad_accum <= smallest,
            f"algorithm.grad_accum ({algorithm.grad_accum}) exceeds the decisions of the smallest minibatch ({smallest} of {decisions}, "
            "algorithm.num_minibatches / algorithm.minibatch_size): lower it, or make the minibatches larger",
        )
        require(
            self.learner.num_learners <= self.actors.num_actors,
            f"learner.num_learners ({self.learner.num_learners}) exceeds actors.num_actors ({self.actors.num_actors}): each learner rank "
            "trains on the rollouts of at least one actor",
        )
        for section in ("actors", "learner"):
            require(
                not getattr(self, section).speed.compile_vision or self.policy.vla_section() is not None,
                f"{section}.speed.compile_vision: policy.type={self.policy.type} has no vision tower to compile (smolvla, pi0 and "
                f"pi05 have): set {section}.speed.compile_vision: false",
            )
            require(
                not getattr(self, section).speed.fused_attention or self.policy.vla_section() is not None,
                f"{section}.speed.fused_attention replaces a VLA's attention (smolvla, pi0 and pi05) and policy.type="
                f"{self.policy.type}: set {section}.speed.fused_attention: false",
            )
        if self.actors.speed.send_image_embeddings:
            section = self.policy.vla_section()
            require(
                section is not None,
                f"actors.speed.send_image_embeddings records a VLA's vision-tower tokens (smolvla, pi0 and pi05) and policy.type="
                f"{self.policy.type} has no vision tower: set actors.speed.send_image_embeddings: false",
            )
            require(
                not getattr(self.policy, section).train_vlm,
                f"actors.speed.send_image_embeddings with policy.{section}.train_vlm: true: the learner would train the vision tower "
                "on tokens the actors computed with older weights; set one of them to false",
            )
        if algorithm.algo == "grpo":
            require(
                self.actors.envs_per_actor % algorithm.group_size == 0,
                f"actors.envs_per_actor ({self.actors.envs_per_actor}) must be a multiple of algorithm.group_size "
                f"({algorithm.group_size}) with algorithm.algo=grpo: a group's rollouts live in one actor's envs",
            )
            require(
                self.actors.decisions_per_rollout * self.policy.chunk_size >= self.env.max_episode_steps,
                f"actors.decisions_per_rollout * policy.chunk_size ({self.actors.decisions_per_rollout * self.policy.chunk_size}) "
                f"must be >= env.max_episode_steps ({self.env.max_episode_steps}) with algorithm.algo=grpo, or no failed "
                "episode ever completes and every group that holds one is masked",
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def fingerprint(self) -> str:
        """Short hash of the resolved config, printed in the banner and stored with checkpoints."""
        return short_digest(self.to_dict(), 12)


def _ray_resources(path: str, num_gpus: float, resources: dict[str, float]) -> None:
    """Ray accepts fractions below 1 and whole numbers above; CPU/GPU have their own fields."""
    for name, amount in {"num_gpus": num_gpus, **{f"resources.{k}": v for k, v in resources.items()}}.items():
        require(
            amount >= 0 and (amount <= 1 or float(amount).is_integer()),
            f"{path}.{name} must be >= 0 and, above 1, a whole number (Ray's rule), got {amount}",
        )
    reserved = sorted({"CPU", "GPU", "memory", "object_store_memory"} & set(resources))
    require(not reserved, f"{path}.resources must not name {reserved}: use {path}.num_cpus / {path}.num_gpus")
