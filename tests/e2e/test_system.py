"""End to end on the tests' local Ray: `learner.main` with 2 actors and a tiny budget, the bare main command on the
embedded default, a run stopped by SIGTERM and resumed exactly."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import pytest
import ray
from safetensors.numpy import load_file

from learner.main import main
from tests.conftest import REPO, TINY_RUN, overrides, tiny_config, tiny_run

pytestmark = pytest.mark.usefixtures("local_ray")


def tiny_args(run_dir, bc_checkpoint, iterations: int, *extra: str) -> list[str]:
    """A small run evaluated after every iteration, at a constant learning rate."""
    return tiny_run(run_dir, bc_checkpoint, "--iterations", str(iterations), *extra, eval_every=1, **{"algorithm.lr_schedule": "constant"})


def weights(directory) -> dict[str, np.ndarray]:
    return load_file(str(directory / "model.safetensors"))


def test_evaluations_do_not_stop_training(tmp_path, bc_checkpoint, monkeypatch) -> None:
    """A held-out evaluation is submitted to the actors and collected once finished, while the loop goes on sampling
    and training. With no evaluation ever reported finished, all 3 iterations still run before any of their
    evaluations is collected, and the rows are written in order at the end, each with its own evaluation."""
    from learner.runtime import actor_pool

    events = []
    collect_sample, collect_evaluate = actor_pool.ActorPool.collect_sample, actor_pool.ActorPool.collect_evaluate

    def spy(name, method):
        def wrapped(self, *args):
            events.append(name)
            return method(self, *args)

        return wrapped

    monkeypatch.setattr(actor_pool.ActorPool, "collect_sample", spy("sample", collect_sample))
    monkeypatch.setattr(actor_pool.ActorPool, "collect_evaluate", spy("eval", collect_evaluate))
    monkeypatch.setattr(actor_pool.ActorPool, "finished", staticmethod(lambda pending: False))
    run_dir = tmp_path / "run"
    assert main(tiny_args(run_dir, bc_checkpoint, 3)) == 0  # eval_every=1
    assert events == ["eval"] + ["sample"] * 3 + ["eval"] * 3  # the initial evaluation, then training never waited
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3] and all(r["eval/episodes"] == 4 for r in rows)
    assert rows[-1]["eval/success_rate"] == json.loads((run_dir / "summary.json").read_text())["final_eval"]["eval/success_rate"]


LAGGED_EVALUATION = {0: ("--set", "eval_every=0"), 1: ("--set", "eval_videos=1")}  # lag 1, the default, evaluated and filmed


@pytest.fixture(scope="module")
def lagged_runs(tmp_path_factory, bc_checkpoint) -> dict[int, Path]:
    """Three iterations at actors.policy_lag 0 and 1 (the default): run directories by lag. The default run is
    evaluated after every iteration and films one held-out episode of each evaluation."""
    runs = {lag: tmp_path_factory.mktemp(f"lag{lag}") / "run" for lag in (0, 1)}
    for lag, run_dir in runs.items():
        assert main(tiny_args(run_dir, bc_checkpoint, 3, *LAGGED_EVALUATION[lag], "--set", f"actors.policy_lag={lag}")) == 0
    return runs


def test_main_loop_trains_broadcasts_and_writes_everything(lagged_runs, bc_checkpoint) -> None:
    run_dir = lagged_runs[1]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["rollout/env_steps"] > 0 and row["eval/episodes"] == 4
        assert np.isfinite(row["losses/pg_loss"]) and np.isfinite(row["logprob/per_element"])
        assert row["time/actors_env_cpu_seconds"] > 0 and row["time/update_cpu_seconds"] > 0
        work = row["time/actors_env_cpu_seconds"] + row["time/actors_policy_cpu_seconds"] + row["time/update_cpu_seconds"]
        assert row["time/env_cpu_share"] == pytest.approx(row["time/actors_env_cpu_seconds"] / work)
    assert (run_dir / "checkpoints" / "latest").read_text() == "iter_000003"
    final, initial = weights(run_dir / "checkpoints" / "iter_000003"), weights(bc_checkpoint)
    assert any(not np.array_equal(final[k], initial[k]) for k in final if k.startswith("velocity_net"))
    state = __import__("torch").load(run_dir / "checkpoints" / "iter_000003" / "trainer_state.pt", weights_only=True)
    assert state["version"] == 3 and state["iteration"] == 3
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["env_steps"] == sum(r["rollout/env_steps"] for r in rows)
    assert "initial_eval" in summary and summary["final_eval"]["eval/episodes"] == 4
    assert (run_dir / "learning_curve.png").stat().st_size > 1000
    assert list((run_dir / "wandb").glob("offline-run-*"))
    # eval_videos=1: after each of the 4 evaluations (initial, iterations 1 to 3), one filmed held-out episode whose
    # outcome in its name is the one its evaluation counted.
    for iteration, row in zip((0, 1, 2, 3), [summary["initial_eval"], *rows]):
        (video,) = (run_dir / "videos" / f"iter_{iteration:06d}").glob("*.mp4")
        with av.open(str(video)) as container:
            assert sum(1 for _ in container.decode(video=0)) > 1
        outcome = "success" if row["eval/success_rate"] == 1.0 else "failure" if row["eval/success_rate"] == 0.0 else None
        assert outcome is None or f"_{outcome}_" in video.name


@pytest.mark.parametrize("policy_lag", [0, 1])
def test_policy_lag_sets_which_version_samples_each_iteration(lagged_runs, policy_lag) -> None:
    """actors.policy_lag=1 (default): iteration 1 trains on v0's rollouts (lag 0); from iteration 2 on, every rollout
    comes from the version before the learner's (it was sampled during the previous update). The behaviour
    log-probs the learner recomputes with those older weights equal the actors' own, and the ratio check passes.
    actors.policy_lag=0 is the synchronous loop: every rollout from the learner's current version."""
    run_dir = lagged_runs[policy_lag]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout/weight_version_lag"] for r in rows] == ([0, 0, 0] if policy_lag == 0 else [0, 1, 1])
    assert [r["rollout/weight_version"] for r in rows] == ([0, 1, 2] if policy_lag == 0 else [0, 0, 1])
    for row in rows:
        assert row["logprob/behaviour_gap_max"] < 1e-5 and row["ppo/first_minibatch_ratio_dev"] <= 1e-5
        assert row["actor/0/weight_version_lag"] == row["rollout/weight_version_lag"]
    if policy_lag:
        assert all(0.5 < r["ppo/behaviour_weight_min"] <= r["ppo/behaviour_weight_max"] < 2 for r in rows[1:])
    state = __import__("torch").load(run_dir / "checkpoints" / "iter_000003" / "trainer_state.pt", weights_only=True)
    assert state["version"] == 3
    assert sorted(state["published"]) == ([] if policy_lag == 0 else [2, 3])  # what iterations 3 and 4 would sample with


# Where a user's run is stopped (tests.helpers.stop_moments), the lag it runs at, and the checkpoint its stop saves:
# waiting on iteration 2's rollout (a second SIGTERM while that checkpoint is written), on iteration 2's update (held
# until the update's row is, tests/unit/test_failures.py), and on the initial held-out evaluation (the run's start).
STOPS = {"rollout:2:save": (0, 1), "update:2": (1, 2), "evaluation:1": (1, 0)}


@pytest.fixture(scope="module")
def stopped_runs(tmp_path_factory, bc_checkpoint) -> dict[str, tuple[Path, subprocess.CompletedProcess, dict]]:
    """`python -m learner.main` stopped by SIGTERM at each of STOPS, each in a process of its own with its own local Ray,
    as a scheduler stops a user's run (the three side by side: most of each is Ray's start-up): moment -> (run directory,
    the finished command, what tests.helpers.stop_moments found at each signal)."""
    runs, commands = {}, {}
    for moment, (lag, _) in STOPS.items():
        run_dir = tmp_path_factory.mktemp("stopped") / "run"
        # rows logged as each iteration ends (no evaluation to wait for), no checkpoint before the signal: what it saves is its own
        argv = tiny_args(run_dir, bc_checkpoint, 3, "--set", "eval_every=0", "--set", "checkpoint_every=10", "--set", "keep_checkpoints=1",
                         "--set", f"actors.policy_lag={lag}", "--no-dashboard")  # fmt: skip
        report = run_dir.parent / "stops.json"
        commands[moment] = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.stop_moments", moment, str(report), *argv],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "RAY_ADDRESS": ""},
        )
        runs[moment] = (run_dir, report)
    finished = {}
    for moment, command in commands.items():
        output = command.communicate(timeout=600)[0]
        run_dir, report = runs[moment]
        finished[moment] = (run_dir, subprocess.CompletedProcess(command.args, command.returncode, output), json.loads(report.read_text()))
    return finished


@pytest.mark.parametrize("moment", list(STOPS))
def test_a_run_stopped_by_sigterm_exits_143_after_its_checkpoint_and_resumes_as_the_uninterrupted_run(
    stopped_runs, lagged_runs, bc_checkpoint, moment
) -> None:
    """Stopped by SIGTERM while its driver waits inside Ray (where Ray 2.60 turns whatever the handler raised into a plain
    KeyboardInterrupt), the run saves its progress (a run stopped before its first iteration, its start: iter_000000),
    says so on one line, exits 143 and prints no error-level line (ray.init's own SIGTERM handler, which logs errors and
    aborts, is replaced once Ray is up). A second SIGTERM while that checkpoint is written is noted, not obeyed. Resumed,
    it ends as the uninterrupted run of its lag bit for bit: at lag 1, iteration 3 was sampled with v1, so the checkpoint
    must hand v1 out again. The interrupted run keeps only its newest checkpoint (keep_checkpoints=1)."""
    lag, saved = STOPS[moment]
    interrupted, command, found = stopped_runs[moment]
    straight = lagged_runs[lag]
    output = command.stdout
    assert command.returncode == 143, output[-3000:]
    waited_on = moment.split(":")[0]
    assert set(found) == {waited_on, *(["save"] if moment.endswith(":save") else [])}, found
    assert all(signal_found["going"] for signal_found in found.values()), found  # each signal came inside its wait
    if waited_on != "update":  # an update's stop is held until its row is (no exception inside the wait)
        assert found[waited_on]["raised"] == "KeyboardInterrupt", found  # what Ray's wait raises for any handler's exception
    assert re.findall(r"\[stopped by SIGTERM\] saved iter_(\d{6}); continue with --resume", output) == [f"{saved:06d}"], output[-3000:]
    assert not [line for line in output.splitlines() if " ERROR " in line or "SIGTERM received" in line], output[-3000:]
    if moment.endswith(":save"):
        assert "[stopping] asked to stop again (SIGTERM): saving the checkpoint first" in output
    assert sorted(p.name for p in (interrupted / "checkpoints").iterdir()) == [f"iter_{saved:06d}", "latest"]

    assert main(tiny_args(interrupted, bc_checkpoint, 3, *LAGGED_EVALUATION[lag], "--set", f"actors.policy_lag={lag}",
                          "--set", "keep_checkpoints=1", "--resume")) == 0  # fmt: skip
    a, b = weights(straight / "checkpoints" / "iter_000003"), weights(interrupted / "checkpoints" / "iter_000003")
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    rows = [[json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] for run in (straight, interrupted)]
    assert [r["iteration"] for r in rows[1]] == [1, 2, 3]
    compared = ("rollout/weight_version", "rollout/episode_return", "losses/pg_loss", "losses/v_loss")
    assert [[r[k] for k in compared] for r in rows[0]] == [[r[k] for k in compared] for r in rows[1]]
    assert [r["rollout/weight_version"] for r in rows[1]] == ([0, 1, 2] if lag == 0 else [0, 0, 1])


@pytest.mark.parametrize("num_demos", [2, None])
def test_a_checkpoint_pretrain_writes_starts_a_run(tmp_path, monkeypatch, num_demos) -> None:
    """`python -m learner.pretrain --out DIR` then `python -m learner.main --checkpoint DIR`: with a count given it trains
    into DIR; with pretrain.num_demos null it searches the count through the cache and copies the chosen checkpoint,
    whose own checksums.json the copy must not list as a file of its own (else every later load finds it corrupt)."""
    from learner import pretrain

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    search = ["pretrain.eval_episodes=20", "pretrain.target_success_min=0.0", "pretrain.target_success_max=1.0"]  # the first count
    fields = {**TINY_RUN, "pretrain.num_demos": num_demos}
    sets = [arg for item in [*overrides(fields), *(search if num_demos is None else [])] for arg in ("--set", item)]
    out = tmp_path / "bc"
    assert pretrain.main([*sets, "--out", str(out)]) == 0
    assert main(tiny_run(tmp_path / "run", out, "--iterations", "1")) == 0
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "iter_000001"


def test_a_learner_that_ran_an_update_has_imported_no_simulator(tmp_path, bc_checkpoint) -> None:
    """The learner's process is handed the run's tasks (learner.runtime.startup.start_learner), so neither its start nor its
    updates import Metaworld or MuJoCo, the seconds of CPU and the memory of the rollout actors' side."""
    from actors.rollout_actor import RolloutActor
    from learner.runtime.learner_actor import LearnerActor

    config = tiny_config(tmp_path)
    batch = RolloutActor(config, 0, bc_checkpoint).sample(None, 0)
    learner = ray.remote(LearnerActor).remote(config, str(bc_checkpoint), None, tasks=[config.env.task])
    metrics = ray.get(learner.update.remote(batch))
    assert np.isfinite(metrics["losses/pg_loss"])
    envs = {"metaworld", "mujoco", "actors.rollout_actor", "common.suites.metaworld"}
    assert ray.get(learner.__ray_call__.remote(lambda actor: sorted(envs & set(sys.modules)))) == []
    ray.kill(learner)


def test_a_payload_of_views_is_frozen_by_ray_put() -> None:
    """The learner publishes views of its weights (no copy, tests/unit/test_trajectory.py): ray.put serialises them
    before it returns, so the updates that follow never reach the published version."""
    import torch

    from common.trajectory import WeightsPayload

    weight = torch.zeros(1000)
    ref = ray.put(WeightsPayload.from_state(7, {"w": weight}, copy=False))
    weight += 1.0  # the next update, in place
    assert ray.get(ref).params["w"].max() == 0.0


def test_layout_tables_built_by_start_up_tasks_reach_the_actors_unresolved(tmp_path, bc_checkpoint, monkeypatch) -> None:
    """Start-up builds the benchmark tables in Ray tasks (one per 4 cores, asking for no CPU) beside the actors' own
    start: together they hold exactly what the driver would build itself, and an actor given the name of a
    LayoutTables actor over their refs reads them instead of simulating any benchmark. Tables the process holds
    already, or reads from the layout cache, go through one put."""
    import common.suites.metaworld as envs_module
    from actors.rollout_actor import RolloutActor
    from learner.runtime.startup import LayoutTables, build_benchmark_tables

    config = tiny_config(tmp_path, **{"env.train_benchmark_seeds": [2, 3], "env.eval_benchmark_seeds": [1]})
    monkeypatch.setattr(envs_module, "_BENCHMARK_TASKS", {})  # a process that has built no table
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty_cache"))  # on a machine that has cached none
    assert len(build_benchmark_tables(config)) == 1  # this Ray has 2 CPUs
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0})
    refs = build_benchmark_tables(config)
    parts = ray.get(refs)
    assert len(refs) == 3 and all(len(part) == 1 for part in parts)  # 3 distinct seeds, at most 16 // 4 tasks
    built = {key: tasks for part in parts for key, tasks in part.items()}
    assert built == envs_module.MetaworldSuite(config.env).layout_tables([("pick-place-v3", seed) for seed in (2, 3, 1)])
    monkeypatch.setattr(envs_module, "_BENCHMARK_TASKS", {})
    monkeypatch.setattr(envs_module.metaworld, "MT1", lambda *args, **kwargs: pytest.fail("built an MT1 benchmark again"))
    tables = ray.remote(LayoutTables).options(name="layout-tables-of-this-test", num_cpus=0).remote(refs)  # noqa: F841  (held)
    actor = RolloutActor(config, 0, bc_checkpoint, "layout-tables-of-this-test")
    assert set(envs_module._BENCHMARK_TASKS) == set(built)
    actor.vec_env.envs[0].set_layout(envs_module.Layout("pick-place-v3", 3, 49))  # any layout of the run resets without a benchmark build
    actor.vec_env.envs[0].reset(seed=0)
    # A later run in a process that holds the tables (start_actors adopts them) shares them with one put, no task.
    monkeypatch.setattr(ray, "remote", lambda *args, **kwargs: pytest.fail("started a task for tables this process holds"))
    (again,) = build_benchmark_tables(config)
    assert ray.get(again) == built


def test_the_bare_main_command_runs_the_embedded_default(tmp_path, capfd) -> None:
    """The first iterations of what a user runs first, `python -m learner.main --num-actors 10`: the embedded default
    config (no --config, no --set), its BC checkpoint chosen by the success window (built on first use, then cached),
    10 actors x 2 envs x 50 decisions into the default update (the critic alone for its 3 warm-up iterations, then the
    actor too), 100 held-out layouts before and after."""
    from common.config import RunConfig, cache_dir

    run_dir = tmp_path / "run"
    assert main(["--num-actors", "10", "--iterations", "4", "--run-dir", str(run_dir)]) == 0
    # The before/after summary is the last thing printed: the last films and wandb's closing lines come before it.
    printed = [line for line in capfd.readouterr().out.splitlines() if line.strip()]
    closing = len(printed) - 2 - printed[-2::-1].index("=" * 78)  # the summary's first rule
    assert printed[-1] == "=" * 78 and printed[closing + 1].startswith("initial policy : success"), printed[-12:]
    assert not [line for line in printed[closing:] if line.startswith(("[videos]", "wandb:"))], printed[closing:]

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["ppo/actor_lr"] > 0 for row in rows] == [False, False, False, True]
    for row in rows:
        assert row["rollout/decisions"] == 1000 and (row["ppo/num_minibatches"], row["ppo/minibatch_size"]) == (2, 500)
        assert row["ppo/first_minibatch_ratio_dev"] <= 1e-5 and row["logprob/behaviour_gap_max"] < 1e-5
    summary = json.loads((run_dir / "summary.json").read_text())
    recorded = summary["manifest"]["config"]
    default = RunConfig().to_dict()
    assert {k: v for k, v in recorded.items() if k not in ("iterations", "run_dir")} == {
        k: v for k, v in default.items() if k not in ("iterations", "run_dir")
    }  # fmt: skip
    start = summary["manifest"]["init_checkpoint"]
    assert start["path"].startswith(str(cache_dir("bc"))) and 0.2 <= start["pretrain"]["eval_success_rate"] <= 0.7
    # The start-up says where its minutes went: building the initial policy, apart from the learner's own start.
    startup = summary["startup"]
    assert startup["ray_up"] < startup["initial_policy"] < startup["learner_ready"]
    assert summary["initial_eval"]["eval/episodes"] == summary["final_eval"]["eval/episodes"] == 100
