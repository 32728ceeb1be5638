"""Faults a run survives, and bad input it refuses before writing anything.

Real `learner.main` runs on local Ray lose a rollout actor (SIGKILL), wedge one (SIGSTOP) or lose the learner
(SIGKILL); each must finish with exactly the results of an undisturbed run, because a retried rollout repeats
the dead attempt's samples and a restarted learner redoes its iterations from the checkpoint. The ActorPool's
own rules (retry, timeout, drop, minimum) are checked on small Ray actors; NaN rollback is in test_learner.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from ray._private import state
from ray.exceptions import OwnerDiedError
from safetensors.numpy import load_file

from actors.rollout_actor import RolloutActor
from common.config import RunConfig
from common.policy import CHECKSUMS_FILE, WEIGHTS_FILE, CheckpointError, FlowPolicy, write_directory_atomically
from common.suites.metaworld import MetaworldTaskEnv
from learner.actor_pool import ActorPool
from learner.failures import ActorsExhaustedError, LearnerDiedError
from learner.learner import Learner
from learner.main import main
from learner.run_dir import RunDirectory
from tests.conftest import tiny_config
from tests.flaky_actor import Flaky, Owner


@pytest.fixture(scope="module")
def local_ray():
    ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


# ---------------------------------------------------------------------------------------------- the actor pool


def pool_of(tmp_path: Path, modes: list[str], **actors: float) -> ActorPool:
    tmp_path.mkdir(exist_ok=True)
    config = tiny_config(tmp_path, **{f"actors.{k}": v for k, v in actors.items()}, **{"actors.num_actors": len(modes)})
    remote = ray.remote(Flaky)
    pool = ActorPool(config, lambda i: remote.options(num_cpus=0, max_restarts=config.actors.max_restarts).remote(
        str(tmp_path / f"marker{i}"), modes[i]))  # fmt: skip
    ray.get([actor.__ray_ready__.remote() for actor in pool.actors.values()])  # start-up is not part of a call's time
    return pool


@pytest.mark.slow
def test_dead_and_wedged_actors_are_restarted_and_their_calls_retried(tmp_path, local_ray) -> None:
    pool = pool_of(tmp_path, ["die", "hang", "ok"], call_timeout_s=5)
    results = pool.call("work", lambda i: (10 * (i + 1),))
    assert {i: ray.get(refs[0]) for i, refs in results.items()} == {0: {"env_steps": 10}, 1: {"env_steps": 20}, 2: {"env_steps": 30}}
    assert pool.restarts == {0: 1, 1: 1, 2: 0}
    assert pool.faults["faults/actor_timeouts"] == 1 and pool.faults["faults/actor_restarts"] == 2
    assert pool.faults["faults/resampled_env_steps"] == 30  # the retried calls' work, counted once each


@pytest.mark.slow
def test_an_actor_out_of_restarts_is_dropped_until_too_few_are_left(tmp_path, local_ray) -> None:
    pool = pool_of(tmp_path / "a", ["die", "ok"], max_restarts=0)
    dropped = r"rollout actor 0 died \(ActorDiedError\) with its 0 restarts spent .*: dropped; training goes on with the 1 left"
    with pytest.warns(RuntimeWarning, match=dropped):
        results = pool.call("work", lambda i: (1,))
    assert list(results) == [1] and list(pool.actors) == [1] and pool.faults["faults/dropped_actors"] == 1
    strict = pool_of(tmp_path / "b", ["die", "ok"], max_restarts=0, min_alive=2)
    with pytest.raises(ActorsExhaustedError, match="1 left, below actors.min_alive=2"):
        strict.call("work", lambda i: (1,))


@pytest.mark.slow
def test_a_call_whose_weights_owner_died_reports_the_learner_dead(tmp_path, local_ray) -> None:
    """The weights a rollout call names are owned by the learner that put them: once it dies, the call cannot get
    them, and the driver must restart the learner (which publishes them again), not fail the run."""
    pool = pool_of(tmp_path, ["ok", "ok"])
    owner = ray.remote(Owner).options(num_cpus=0).remote()
    (weights,) = ray.get(owner.put.remote(10**7))  # the size of small weights, so not inlined into the reply
    ray.kill(owner)
    with pytest.raises(OwnerDiedError):  # once Ray knows the owner is gone (until then a copy may still be read)
        while True:
            ray.get(weights, timeout=60)
            time.sleep(0.05)
    with pytest.raises(LearnerDiedError, match="the learner that published the weights of rollout actor 0's work call died"):
        pool.call("work", lambda i: (weights,))


# ---------------------------------------------------------------------------------------------- real runs


def run_args(run_dir: Path, bc_checkpoint: Path, *extra: str) -> list[str]:
    sets = ["actors.envs_per_actor=2", "actors.decisions_per_rollout=30", "env.max_episode_steps=60", "algorithm.minibatch_size=40",
            "algorithm.update_epochs=2", "eval_every=0", "eval_episodes=4", "checkpoint_every=1",
            "algorithm.critic_warmup_iters=0"]  # fmt: skip
    argv = ["--num-actors", "2", "--iterations", "5", "--run-dir", str(run_dir), "--checkpoint", str(bc_checkpoint)]
    return argv + [a for item in sets for a in ("--set", item)] + list(extra)


COMPARED = ("rollout/env_steps", "rollout/total_env_steps", "rollout/episode_return", "losses/pg_loss", "losses/v_loss")


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def signal_when(run_dir: Path, actor_class: str, signum: int, after_rows: int) -> threading.Thread:
    """Send `signum` to this Ray session's `actor_class` process once the run has logged `after_rows` iterations."""

    def act() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            log = run_dir / "metrics.jsonl"
            if log.is_file() and len(log.read_text().splitlines()) >= after_rows:
                pids = [a["Pid"] for a in state.actors().values() if a["ActorClassName"] == actor_class and a["State"] == "ALIVE"]
                os.kill(pids[0], signum)
                return
            time.sleep(0.02)

    thread = threading.Thread(target=act, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory, bc_checkpoint, local_ray) -> Path:
    run_dir = tmp_path_factory.mktemp("undisturbed") / "run"
    assert main(run_args(run_dir, bc_checkpoint)) == 0
    return run_dir


def assert_same_run(run_dir: Path, reference: Path) -> None:
    got, want = {r["iteration"]: r for r in rows(run_dir)}, {r["iteration"]: r for r in rows(reference)}
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5]
    for iteration, row in want.items():
        assert {k: got[iteration][k] for k in COMPARED} == {k: row[k] for k in COMPARED}, f"iteration {iteration} differs"
    final = "checkpoints/iter_000005/" + WEIGHTS_FILE
    a, b = load_file(str(run_dir / final)), load_file(str(reference / final))
    assert all(np.array_equal(a[k], b[k]) for k in b), "final weights differ from the undisturbed run's"


@pytest.mark.slow
@pytest.mark.parametrize(("actor_class", "signum", "extra", "counter"), [
    ("RolloutActor", signal.SIGKILL, (), "faults/actor_restarts"),
    ("RolloutActor", signal.SIGSTOP, ("--set", "actors.call_timeout_s=60"), "faults/actor_timeouts"),
    ("LearnerActor", signal.SIGKILL, (), "faults/learner_restarts"),
    # No checkpoint before the kill: the learner restarts from the run's start while the actors hold newer versions.
    ("LearnerActor", signal.SIGKILL, ("--set", "checkpoint_every=5"), "faults/learner_restarts"),
], ids=["rollout-actor-killed", "rollout-actor-wedged", "learner-killed", "learner-killed-before-any-checkpoint"])  # fmt: skip
def test_a_run_survives_the_fault_with_the_undisturbed_results(tmp_path, bc_checkpoint, undisturbed, actor_class, signum, extra,
                                                               counter, capsys) -> None:  # fmt: skip
    run_dir = tmp_path / "run"
    killer = signal_when(run_dir, actor_class, signum, after_rows=2)
    assert main(run_args(run_dir, bc_checkpoint, *extra)) == 0
    killer.join(timeout=1)
    assert "[fault]" in capsys.readouterr().out
    assert rows(run_dir)[-1][counter] == 1.0
    assert_same_run(run_dir, undisturbed)  # nothing lost, nothing counted twice
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["faults"][counter] == 1.0 and summary["env_steps"] == rows(undisturbed)[-1]["rollout/total_env_steps"]


@pytest.mark.slow
def test_the_summary_reports_what_the_run_held_for_how_long_and_where_its_start_went(undisturbed) -> None:
    from learner.startup import STARTUP_STAGES

    summary = json.loads((undisturbed / "summary.json").read_text())
    cost = summary["cost"]
    # On the 2-CPU local Ray: the learner holds 0.5 CPU and each of the 2 actors (2 - 0.5) / 2, for the whole run.
    assert cost["cpu_seconds_reserved"] == pytest.approx(2.0 * cost["wall_seconds"], rel=1e-9)
    assert cost["gpu_seconds_reserved"] == 0.0 and cost["env_steps"] == rows(undisturbed)[-1]["rollout/total_env_steps"]
    assert 0 < rows(undisturbed)[-1]["cost/wall_seconds"] <= cost["wall_seconds"]
    # Every stage, once, in seconds since the run began; what needs another stage comes after it.
    startup = summary["startup"]
    assert list(startup) == sorted(startup, key=startup.get) and set(startup) == set(STARTUP_STAGES)
    assert 0 < startup["ray_up"] < startup["actors_ready"] <= startup["weights_published"] < startup["initial_evaluation"]
    assert startup["input_checked"] <= startup["actors_ready"] and startup["learner_ready"] <= startup["weights_published"]
    assert startup["initial_evaluation"] < startup["first_rollout"] < cost["wall_seconds"]


@pytest.mark.slow
def test_an_unexpected_error_saves_the_completed_iterations_first(tmp_path, bc_checkpoint, undisturbed, monkeypatch) -> None:
    from learner import reporting

    lines = []

    def failing_console_line(metrics):  # the driver breaks after logging iteration 3 (checkpoints every 100 iterations)
        lines.append(metrics["iteration"])
        if len(lines) == 3:
            raise RuntimeError("a bug in the driver")
        return ""

    monkeypatch.setattr(reporting, "console_line", failing_console_line)
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match="a bug in the driver"):
        main(run_args(run_dir, bc_checkpoint, "--set", "checkpoint_every=100"))
    assert (run_dir / "checkpoints" / "latest").read_text() == "iter_000003"
    saved = load_file(str(run_dir / "checkpoints" / "iter_000003" / WEIGHTS_FILE))
    assert saved.keys() and RunDirectory(run_dir).checkpoint_problem(run_dir / "checkpoints" / "iter_000003") is None
    monkeypatch.undo()
    assert main(run_args(run_dir, bc_checkpoint, "--resume")) == 0  # checkpoint_every may change on resume
    assert_same_run(run_dir, undisturbed)  # and the resumed run ends where the undisturbed one did


# ---------------------------------------------------------------------------------------------- broken envs


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


# ---------------------------------------------------------------------------------------------- checkpoints


def test_checkpoints_carry_checksums_and_a_corrupt_one_is_refused_by_name(tmp_path, bc_checkpoint) -> None:
    run = RunDirectory(tmp_path / "run")
    policy = FlowPolicy.from_pretrained(bc_checkpoint)
    for name in ("iter_000001", "iter_000002"):
        write_directory_atomically(run.checkpoints / name, lambda d: (policy.save_pretrained(d), torch.save({}, d / "trainer_state.pt")))
    run.write_latest("iter_000002")
    listed = json.loads((run.checkpoints / "iter_000002" / CHECKSUMS_FILE).read_text())
    assert set(listed) == {WEIGHTS_FILE, "config.json", "trainer_state.pt"}
    weights = run.checkpoints / "iter_000002" / WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in a tensor: same size, a valid header, wrong numbers
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{weights} does not match its sha256"):
        FlowPolicy.from_pretrained(weights.parent)
    assert run.latest_checkpoint().name == "iter_000001"  # the previous good one


# ---------------------------------------------------------------------------------------------- bad input


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
    (["--set", "learner.clip_epsilon=0.1"], r"unknown field.*learner\.clip_epsilon", None),
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
    (["--set", "actors.min_alive=20"], r"actors\.min_alive \(20\) must be <= actors\.num_actors \(10\)", None),
    (["--set", "actors.call_timeout_s=0"], r"actors\.call_timeout_s must be > 0", None),
    (["--set", "algorithm.gamma=1.5"], r"algorithm\.gamma must be in \(0, 1\]", None),
    (["--set", "keep_checkpoints=-1"], r"keep_checkpoints must be >= 0 \(0: keep every one\), got -1", None),
    (["--set", "actors.precision=fp8"], r"actors\.precision must be one of", None),
    (["--set", "actors.compile_vision=true"], r"actors\.compile_vision: policy\.type=mlp_flow has no vision tower to compile", None),
    (["--set", "learner.compile_vision=true"], r"learner\.compile_vision: policy\.type=mlp_flow has no vision tower to compile", None),
    (
        ["--set", "learner.recompute_steps=true", "--set", "learner.steps_in_one_pass=true"],
        r"learner\.recompute_steps and learner\.steps_in_one_pass: choose one",
        None,
    ),
    (
        ["--set", "learner.recompute_steps=true", "--set", "learner.compile_steps=true"],
        r"learner\.recompute_steps and learner\.compile_steps: choose one",
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


@pytest.mark.parametrize("field", ["actors.compile_steps", "learner.compile_steps"])
def test_compiled_steps_without_a_kernel_compiler_are_refused_before_anything_is_written(
    tmp_path, bc_checkpoint, capsys, monkeypatch, field
) -> None:
    """actors.compile_steps or learner.compile_steps on a local run whose machine has no compiler for torch.compile's kernels."""
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


def test_the_bad_input_table_covers_thirty_cases_on_the_defaults_it_assumes() -> None:
    assert len(BAD_INPUTS) >= 30
    assert RunConfig().algorithm.critic_warmup_iters == 3 and RunConfig().iterations == 150
