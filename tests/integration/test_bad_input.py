"""Bad input a run refuses before anything is written, one line each, and broken input it survives: an env that
returns NaN, a rollout whose every episode broke.

`learner.main` runs here without Ray: every refusal comes before a run needs it, so the Ray a run starts beside its
input checks is stubbed out (tests/e2e/test_cluster.py checks that a run which starts its own Ray and then finds bad
input shuts that Ray down and writes nothing).
"""

from __future__ import annotations

import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

import learner.main as main_module
from actors.rollout_actor import RolloutActor
from common.config import RunConfig
from common.config_loading import load_config
from common.diagnostics import ShortRolloutWarning
from common.policy import CHECKSUMS_FILE, WEIGHTS_FILE, FlowPolicy
from common.suites.metaworld import MetaworldTaskEnv
from learner.main import main
from learner.runtime.reporting import banner
from learner.runtime.startup import preflight, warn_of_config_traps
from learner.update.learner import Learner, update_shape
from tests.conftest import REPO, tiny_config, tiny_run


@pytest.fixture(autouse=True)
def ray_left_unstarted(monkeypatch) -> None:
    """A run's Ray, which starts beside the input checks, is left unstarted (as if this process held one already)."""
    monkeypatch.setattr(main_module, "connect_ray", lambda address, include_dashboard: False)


def corrupt_copy(bc_checkpoint: Path, where: Path, damage) -> Path:
    copy = where / "ckpt"
    shutil.copytree(bc_checkpoint, copy)
    damage(copy)
    return copy


def break_config_json(directory: Path) -> None:
    (directory / CHECKSUMS_FILE).unlink(missing_ok=True)  # a hand-made directory: no checksums to catch it first
    (directory / "config.json").write_text("{")


def flip_last_byte(directory: Path) -> None:
    data = bytearray((directory / WEIGHTS_FILE).read_bytes())
    data[-1] ^= 0xFF
    (directory / WEIGHTS_FILE).write_bytes(bytes(data))


# (argv after --run-dir/--checkpoint, message regex, optional setup(tmp_path, bc_checkpoint) -> extra argv)
BAD_INPUTS = [
    (["--set", "learner.clip_epsilon=0.1"], r"unknown field.*learner\.clip_epsilon -> algorithm\.clip_eps\?", None),
    (["--set", "policy.time_embed_dim=33"], r"policy\.time_embed_dim must be even .*got 33", None),
    (["--set", "policy.hidden_dim=1"], r"policy\.hidden_dim must be >= 2", None),
    (
        [
            "--set",
            "actors.num_actors=1",
            "--set",
            "actors.envs_per_actor=1",
            "--set",
            "actors.decisions_per_rollout=1",
            "--set",
            "algorithm.minibatch_size=1",
        ],
        r"one rollout holds a single decision",
        None,
    ),
    (["--set", "algorithm.clip_eps=2"], r"algorithm\.clip_eps must be in \(0, 1\)", None),
    (["--set", "algorithm.clip_eps=[1"], r"override 'algorithm\.clip_eps=\[1': the value is not valid YAML", None),
    ([], r"config file .*bad\.yaml is not valid YAML", lambda p, c: ["--config", _write(p / "bad.yaml", "learner: [\n")]),
    ([], r"config file .*list\.yaml must hold a mapping", lambda p, c: ["--config", _write(p / "list.yaml", "- 1\n")]),
    (["--config", "/nonexistent/run.yaml"], r"config file /nonexistent/run\.yaml does not exist", None),
    (["--set", "env.task=pick-place-v9"], r"env\.task: unknown task 'pick-place-v9'", None),
    (["--set", "env.train_benchmark_seeds=[-1]"], r"env\.train_benchmark_seeds must be distinct seeds >= 0", None),
    (["--set", "env.train_benchmark_seeds=[2, 2]"], r"env\.train_benchmark_seeds must be distinct seeds >= 0", None),
    (["--set", "env.eval_benchmark_seeds=[2]"], r"env\.eval_benchmark_seeds \[2\] also used for training", None),
    (["--seed", "-1"], r"seed must be >= 0, got -1", None),
    (["--set", "algorithm.actor_lr=.nan"], r"algorithm\.actor_lr must be a finite number", None),
    (["--set", "algorithm.actor_lr=inf"], r"algorithm\.actor_lr must be a finite number", None),
    (["--set", "algorithm.minibatch_size=5000"], r"algorithm\.minibatch_size \(5000\) exceeds the decisions of one rollout \(1000", None),
    (["--set", "algorithm.lr_warmup_iters=300"], r"algorithm\.lr_warmup_iters \(300\) must be < iterations \(150\)", None),
    (["--set", "algorithm.lr_warmup_iters=-1"], r"algorithm\.lr_warmup_iters/critic_warmup_iters must be >= 0", None),
    (["--iterations", "2"], r"algorithm\.critic_warmup_iters \(3\) must be < iterations \(2\)", None),
    (["--set", "env.max_episode_steps=501"], r"env\.max_episode_steps \(501\) exceeds metaworld's episode limit for pick-place-v3", None),
    (["--set", "env.suite=maniskill"], r"env\.suite 'maniskill' is not one of \['gym', 'libero', 'metaworld'\]", None),
    (["--set", "env.suite=gym", "--set", "env.gym.success_key=''"], r"env\.gym\.success_key must be a non-empty string", None),
    (["--set", "policy.type=transformer"], r"policy\.type must be one of \['mlp_flow', 'pi0', 'pi05', 'smolvla'\]", None),
    (["--set", "actors.num_gpus=0.5"], r"actors\.num_gpus=0\.5 .* ask for GPUs but this machine has none", None),
    (["--num-actors", "100000"], r"actors\.num_actors=100000 leaves each actor .* CPU", None),
    (["--set", "policy.obs_dim=20"], r"disagrees with the checkpoint .*policy\.obs_dim: checkpoint 39, config 20", None),
    ([], r"init checkpoint .*missing has no model\.safetensors", lambda p, c: ["--checkpoint", str(p / "missing")]),
    (
        [],
        r"config\.json is not valid JSON",  # a hand-made directory (no checksums) with a broken config
        lambda p, c: ["--checkpoint", str(corrupt_copy(c, p, break_config_json))],
    ),
    ([], r"model\.safetensors does not match its sha256", lambda p, c: ["--checkpoint", str(corrupt_copy(c, p, flip_last_byte))]),
    (["--set", "eval_episodes=1000"], r"eval_episodes=1000 but env\.eval_benchmark_seeds give only 100 layouts", None),
    (["--run-dir", ""], r"run_dir must not be empty", None),
    (["--iterations", "0"], r"iterations must be > 0", None),
    (["--num-actors", "0"], r"actors\.num_actors must be > 0", None),
    (["--algo", "grpo", "--set", "actors.envs_per_actor=3"], r"actors\.envs_per_actor \(3\) must be a multiple of", None),
    (["--set", "policy.sigma_min=0.5"], r"policy\.sigma_min/sigma_max must satisfy", None),
    (["--set", "algorithm.kl_estimator=k4"], r"algorithm\.kl_estimator must be one of", None),
    (["--set", "actors.faults.min_alive=20"], r"actors\.faults\.min_alive \(20\) must be <= actors\.num_actors \(10\)", None),
    (["--set", "actors.faults.call_timeout_s=0"], r"actors\.faults\.call_timeout_s must be > 0", None),
    (["--set", "algorithm.gamma=1.5"], r"algorithm\.gamma must be in \(0, 1\]", None),
    (["--set", "keep_checkpoints=-1"], r"keep_checkpoints must be >= 0 \(0: keep every one\), got -1", None),
    (["--set", "stall_compare=previous"], r"stall_compare must be one of \('first', 'first_or_previous'\), got 'previous'", None),
    (["--set", "policy.action_bounds=[0, 512]"], r"policy\.action_bounds must be empty or 8 numbers", None),
    (
        ["--set", "policy.rename_map={observation.images.nowhere: observation.image}"],
        r"policy\.rename_map maps \['observation\.images\.nowhere'\], which .* not give \(it gives observation\.images\.corner \(corner\)",
        None,
    ),
    (["--set", "policy.action_bounds=[-2, -2, -2, -2, 2, 2, 2, 2]"], r"policy\.action_bounds .* are not the env units metaworld", None),
    (
        ["--set", "env.suite=gym", "--set", "env.task=MountainCarContinuous-v0", "--set", "env.observations=lerobot"],
        r"env\.observations 'lerobot' gives what lerobot's env config of an env id gives.*use env\.observations 'project'",
        None,
    ),
    (["--set", "actors.speed.precision=fp8"], r"actors\.speed\.precision must be one of", None),
    (
        ["--set", "actors.speed.compile_vision=true"],
        r"actors\.speed\.compile_vision: policy\.type=mlp_flow has no vision tower to compile",
        None,
    ),
    (
        ["--set", "learner.speed.compile_vision=true"],
        r"learner\.speed\.compile_vision: policy\.type=mlp_flow has no vision tower to compile",
        None,
    ),
    (
        ["--set", "learner.speed.fused_attention=true"],
        r"learner\.speed\.fused_attention replaces a VLA's attention \(smolvla, pi0 and pi05\) and policy\.type=mlp_flow",
        None,
    ),
    (
        ["--set", "actors.speed.send_image_embeddings=true"],
        r"actors\.speed\.send_image_embeddings records a VLA's vision-tower tokens .* policy\.type=mlp_flow has no vision tower",
        None,
    ),
    (
        ["--set", "learner.speed.recompute_steps=true", "--set", "learner.speed.steps_in_one_pass=true"],
        r"learner\.speed\.recompute_steps and learner\.speed\.steps_in_one_pass: choose one",
        None,
    ),
    (
        ["--set", "learner.speed.recompute_steps=true", "--set", "learner.speed.compile_steps=true"],
        r"learner\.speed\.recompute_steps and learner\.speed\.compile_steps: choose one",
        None,
    ),
    (["--resume"], r"--resume: no checkpoint under", None),
    (["--resume", "--allow-config-change", "learner.nonsense"], r"--allow-config-change names no config field", None),
]


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def files_under(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


@pytest.mark.parametrize(("argv", "message", "setup"), BAD_INPUTS, ids=[f"{i:02d}" for i in range(len(BAD_INPUTS))])
def test_bad_input_is_refused_with_a_clear_message_and_nothing_written(tmp_path, bc_checkpoint, capsys, argv, message, setup) -> None:
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    extra = setup(inputs, bc_checkpoint) if setup else []
    defaults = ["--run-dir", str(tmp_path / "run"), "--checkpoint", str(bc_checkpoint)]
    before = files_under(tmp_path)
    assert main(defaults + extra + argv) == 2  # later flags win: a case's own --run-dir or --checkpoint replaces the default
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(message, err), err
    assert files_under(tmp_path) == before, "a refused run wrote files"


@pytest.mark.parametrize("field", ["actors.speed.compile_steps", "learner.speed.compile_steps"])
def test_compiled_steps_without_a_kernel_compiler_are_refused_before_anything_is_written(
    tmp_path, bc_checkpoint, capsys, monkeypatch, field
) -> None:
    """actors.speed.compile_steps or learner.speed.compile_steps on a local run whose machine has no compiler for
    torch.compile's kernels."""
    import shutil

    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    before = files_under(tmp_path)
    argv = ["--run-dir", str(tmp_path / "run"), "--checkpoint", str(bc_checkpoint), "--set", f"{field}=true"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(rf"{re.escape(field)}: torch\.compile builds its cpu kernels with a compiler, and none is installed", err), err
    assert files_under(tmp_path) == before, "a refused run wrote files"


def test_a_second_run_never_overwrites_the_first(tmp_path, bc_checkpoint, capsys) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("")
    assert main(tiny_run(run_dir, bc_checkpoint)) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (run_dir / "metrics.jsonl").read_text() == "" and [p.name for p in run_dir.iterdir()] == ["metrics.jsonl"]


def test_the_bad_input_table_covers_thirty_cases_on_the_defaults_it_assumes() -> None:
    assert len(BAD_INPUTS) >= 30
    assert RunConfig().algorithm.critic_warmup_iters == 3 and RunConfig().iterations == 150


def test_an_env_returning_nan_ends_its_episode_and_its_samples_are_dropped(tmp_path, bc_checkpoint, monkeypatch) -> None:
    config = tiny_config(tmp_path)
    actor = RolloutActor(config, 0, bc_checkpoint)
    broken = actor.vec_env.envs[1]
    original, calls = MetaworldTaskEnv.step, []

    def step(self, action):
        obs, reward, terminated, truncated, info = original(self, action)
        if self is broken:
            calls.append(1)
            if len(calls) == 10:  # the 10th env step of env 1, inside its 3rd chunk decision
                obs = np.full_like(obs, np.nan)
        return obs, reward, terminated, truncated, info

    monkeypatch.setattr(MetaworldTaskEnv, "step", step)
    batch = actor.sample(None, 0)
    batch.validate()  # every float in the record is finite
    assert batch.valid[:, 0].all() and not batch.valid[:3, 1].any() and batch.valid[3:, 1].all()
    assert batch.truncated[2, 1]
    ended = batch.terminated | batch.truncated
    assert len(batch.episode_returns) == int((ended & batch.valid).sum())  # the broken episode is not in the statistics
    learner = Learner(config, FlowPolicy.from_pretrained(bc_checkpoint))
    assert len(learner.prepare(batch).old_log_probs) == batch.valid.sum()
    metrics = learner.update(batch)
    assert learner.version == 1 and np.isfinite(metrics["losses/pg_loss"])


def test_a_rollout_where_every_episode_broke_is_a_skipped_update(tmp_path, bc_checkpoint) -> None:
    config = tiny_config(tmp_path)
    batch = RolloutActor(config, 0, bc_checkpoint).sample(None, 0)
    batch.valid = np.zeros_like(batch.valid)
    learner = Learner(config, FlowPolicy.from_pretrained(bc_checkpoint))
    with pytest.warns(RuntimeWarning, match="every decision of this rollout belongs to an episode"):
        assert learner.update(batch)["faults/skipped_update"] == 1.0


def test_the_drivers_start_up_for_a_pi0_run_builds_no_policy(monkeypatch) -> None:
    """What the driver does before the learner starts (the input checks, the ratio-sensitivity warning, the banner and the
    update's shape) reads the config alone: for configs/pi0_pick.yaml no policy of 3 billion parameters is built on the
    head node. A policy built anywhere on that path fails this test."""

    def built(*args, **kwargs) -> None:
        raise AssertionError("the driver's start-up built a policy")

    monkeypatch.setattr(FlowPolicy, "__init__", built)
    config = load_config(REPO / "configs" / "pi0_pick.yaml")
    assert len(preflight(config, "10.0.0.1:6379", resume=False)) == config.eval_episodes  # a cluster's address: no local GPU check
    warn_of_config_traps(config)
    assert "pi0" in banner(config, None, None, {"CPU": 64.0, "GPU": 8.0}, 2.0)
    assert update_shape(config).startswith("512 decisions per iteration")


def test_a_rollout_shorter_than_an_episode_is_warned_of_at_the_start_with_the_count_that_holds_one():
    """Every rollout starts its envs afresh, so a rollout of fewer env steps than env.max_episode_steps cuts every
    longer episode: the start-up warns, naming the decisions that hold a whole episode. The recipes that hold one
    start without it."""
    config = load_config(REPO / "configs" / "libero_object.yaml", ["env.max_episode_steps=250", "actors.decisions_per_rollout=50"])
    with pytest.warns(ShortRolloutWarning, match=r"is 200 env steps, fewer than env.max_episode_steps=250.*decisions_per_rollout: 63$"):
        warn_of_config_traps(config)
    for name in ("pick_place.yaml", "mt10.yaml", "libero_object.yaml"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", ShortRolloutWarning)
            warn_of_config_traps(load_config(REPO / "configs" / name))
