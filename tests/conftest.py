"""Test-wide settings, the tiers, the fixtures every tier shares and the one small-run builder.

Tiers, by directory: tests/unit (no simulator, no Ray), tests/integration (simulators, policies, the learner and
rollout actor in one process), tests/e2e (`learner.main` on a local Ray; marked `slow` here, so `-m "not slow"` runs
the first two). Headless MuJoCo rendering must be chosen before mujoco is first imported.
"""

import json
import os
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import pytest  # noqa: E402

from common.config import RunConfig  # noqa: E402
from common.config_loading import load_config  # noqa: E402

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

# The one small-run budget every test run starts from (seconds, not minutes): a test overrides what it is about.
TINY_RUN = {
    "pretrain.num_demos": 2, "pretrain.train_steps": 60, "pretrain.eval_episodes": 0,
    "policy.hidden_dim": 64, "policy.num_layers": 2,
    "actors.num_actors": 2, "actors.envs_per_actor": 2, "actors.decisions_per_rollout": 8, "env.max_episode_steps": 40,
    "algorithm.minibatch_size": 16, "algorithm.update_epochs": 2, "algorithm.critic_warmup_iters": 0,
    "iterations": 2, "eval_every": 0, "eval_episodes": 4, "eval_videos": 0, "checkpoint_every": 1,
}  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    # torch.compile's CPU kernels without SIMD, which the C++ compiler builds much faster (README, Development); what
    # the tests check of a compiled path (one graph, no break, the eager numbers within rounding, fewer ATen ops
    # dispatched) holds the same. Runs compile for GPUs, whose kernels this does not touch.
    import torch._inductor.config

    torch._inductor.config.cpp.simdlen = 1


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if (TESTS / "e2e") in Path(item.path).parents:
            item.add_marker(pytest.mark.slow)


def overrides(fields: dict) -> list[str]:
    """`section.field=value` strings for load_config / --set: a str is YAML as written, anything else JSON (YAML too)."""
    return [f"{name}={value if isinstance(value, str) else json.dumps(value)}" for name, value in fields.items()]


def tiny_config(tmp_path: Path, config_file: str | Path | None = None, **fields) -> RunConfig:
    """A small run's config: `config_file` (or the embedded defaults) with TINY_RUN and then `fields` over it
    (`section.field` names, as `**{"actors.speed.precision": "bfloat16"}`), its run_dir under tmp_path."""
    return load_config(config_file, overrides({**TINY_RUN, "run_dir": str(tmp_path / "run"), **fields}))


def tiny_run(run_dir: Path, checkpoint: Path | None, *argv: str, config_file: str | Path | None = None, **fields) -> list[str]:
    """`learner.main`'s command line for the same small run: TINY_RUN and `fields` as --set, then `argv` (later flags
    win, so `--iterations 3` in argv overrides TINY_RUN's)."""
    head = ["--run-dir", str(run_dir)] + (["--checkpoint", str(checkpoint)] if checkpoint else [])
    head += ["--config", str(config_file)] if config_file else []
    return head + [arg for item in overrides({**TINY_RUN, **fields}) for arg in ("--set", item)] + list(argv)


@pytest.fixture(scope="session")
def bc_checkpoint(tmp_path_factory) -> Path:
    """A small behaviour-cloned MLP checkpoint of pick-place, built once per test session (simulates demonstrations)."""
    from learner.bc.training import pretrain

    out = tmp_path_factory.mktemp("bc") / "checkpoint"
    pretrain(tiny_config(tmp_path_factory.mktemp("cfg")), out, progress=False)
    return out


@pytest.fixture(scope="session")
def mlp_checkpoint(tmp_path_factory) -> Path:
    """A checkpoint of the tiny run's MLP policy with seeded random weights and normalisation, as save_pretrained
    writes it: for the tests that need a loadable policy but not a trained one (no simulator)."""
    import torch

    from common.policy import build_policy, write_directory_atomically

    torch.manual_seed(0)
    config = tiny_config(tmp_path_factory.mktemp("cfg"))
    policy = build_policy(config.policy)
    obs_dim, action_dim = config.policy.obs_dim, config.policy.action_dim
    policy.set_normalization(torch.linspace(-1, 1, obs_dim), torch.full((obs_dim,), 0.5), torch.zeros(action_dim), torch.ones(action_dim))
    return write_directory_atomically(tmp_path_factory.mktemp("mlp") / "checkpoint", policy.save_pretrained)


@pytest.fixture(scope="session")
def fault_plan(tmp_path_factory) -> Path:
    """Where tests.helpers.fault_injection looks for its plan in the workers of the tests' local Ray (unarmed: none)."""
    return tmp_path_factory.mktemp("faults") / "plan.json"


@pytest.fixture(scope="session")
def _local_ray_session(fault_plan):
    yield
    import ray

    ray.shutdown()


@pytest.fixture(scope="module")
def local_ray(_local_ray_session, fault_plan) -> None:
    """A local Ray of 2 CPUs on loopback, started the way a run starts its own (learner.runtime.ray_runtime.start_local_ray):
    one for every module that asks for it, started again for a module after one whose tests shut it down (no_ray). Its
    workers carry tests.helpers.fault_injection, idle until a test arms the plan. A run in this process uses this Ray
    instead of starting one."""
    import ray

    from learner.runtime.ray_runtime import start_local_ray
    from tests.helpers import fault_injection

    if not ray.is_initialized():
        start_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env=fault_injection.runtime_env(fault_plan))


@pytest.fixture
def no_ray() -> None:
    """No Ray in this process: the test starts (or must not find) its own."""
    import ray

    ray.shutdown()
    yield
    ray.shutdown()


@pytest.fixture
def hashed_files(monkeypatch) -> list[Path]:
    """The files common.file_digests hashes from now on, in a process that keeps no digest yet; digests are kept at
    once (no racy window)."""
    from common import file_digests

    hashed: list[Path] = []
    monkeypatch.setattr(file_digests, "_digests", {})
    monkeypatch.setattr(file_digests, "RACY_SECONDS", -1e9)
    hash_file = file_digests.hash_file
    monkeypatch.setattr(file_digests, "hash_file", lambda path: hashed.append(path) or hash_file(path))
    return hashed
