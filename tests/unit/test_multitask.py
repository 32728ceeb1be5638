"""Multi-task runs, before any env steps: env.task names several tasks (or MT10/MT50), the envs take them in turn, the
checks before a run, and gauges tagged per task."""

from __future__ import annotations

import json
import math

import pytest

from common.config import ConfigError, EnvConfig, PolicyConfig
from common.config_loading import load_config
from common.metrics import counts_interval, describe_stall, stalled_tasks, task_key, why_inside
from common.rollout import env_tasks, episode_groups, group_tasks
from common.suites import Layout, make_suite
from common.suites.metaworld import TASK_SETS, TASKS
from learner.runtime.monitoring import GaugeExporter
from learner.runtime.startup import preflight
from tests.conftest import REPO, tiny_config

TWO_TASKS = "reach-v3,pick-place-v3"


def test_task_names_and_sets_resolve_and_bad_ones_are_named() -> None:
    assert make_suite(EnvConfig(task="MT10")).tasks() == list(TASK_SETS["MT10"])
    assert len(make_suite(EnvConfig(task="MT50")).tasks()) == 50 and set(TASK_SETS["MT50"]) == set(TASKS)
    assert make_suite(EnvConfig(task=" reach-v3 , push-v3")).tasks() == ["reach-v3", "push-v3"]
    with pytest.raises(ValueError, match="unknown task 'fly-v3'"):
        make_suite(EnvConfig(task="reach-v3,fly-v3")).tasks()
    with pytest.raises(ValueError, match="names a task twice"):
        make_suite(EnvConfig(task="reach-v3,reach-v3")).tasks()
    suite = make_suite(EnvConfig(task=TWO_TASKS))
    assert suite.state_dim() == 39 + 2
    with pytest.raises(ConfigError, match=r"policy\.obs_dim=39 but the state of the 2 tasks of .* has 41 elements"):
        suite.check(PolicyConfig())


def test_envs_take_the_tasks_in_turn_and_every_iteration_samples_each_equally() -> None:
    tasks = ["a", "b", "c"]
    everyone = [task for actor in range(3) for task in env_tasks(group_tasks(tasks, 6), actor, 2)]
    assert everyone == ["a", "b", "c", "a", "b", "c"]
    grouped = [task for actor in range(3) for task in env_tasks(group_tasks(tasks, 6), actor, 4, group_size=2)]
    assert grouped == ["a", "a", "b", "b", "c", "c", "a", "a", "b", "b", "c", "c"]  # a GRPO group shares its task


@pytest.mark.parametrize("num_groups", [5, 8, 24, 120, 121])
def test_weighted_tasks_get_envs_in_proportion_at_least_one_each_and_interleaved(num_groups) -> None:
    """group_tasks against the shares computed here: one group for each task, and of the rest each task's fraction
    by weight, rounded down or up, the counts summing to num_groups; and no task's groups bunched together (between
    two of a task's groups at most one more than an even spread leaves)."""
    tasks = ["solved-a", "hard-b", "hard-c", "solved-d", "hard-e"]
    weights = {"solved-a": 0.25, "solved-d": 0.25}
    dealt = group_tasks(tasks, num_groups, weights)
    assert len(dealt) == num_groups
    total = sum(weights.get(task, 1.0) for task in tasks)
    for task in tasks:
        share = (num_groups - len(tasks)) * weights.get(task, 1.0) / total
        count = dealt.count(task)
        assert 1 + math.floor(share) <= count <= 1 + math.ceil(share)
        where = [i for i, name in enumerate(dealt) if name == task]
        assert all(later - earlier <= math.ceil(num_groups / count) + 1 for earlier, later in zip(where, where[1:]))
    if num_groups >= 24:
        assert dealt.count("hard-b") > 3 * dealt.count("solved-a") - 3
    with pytest.raises(ValueError, match="4 env groups cannot sample 5 tasks"):
        group_tasks(tasks, 4)


def test_an_actors_held_out_share_runs_in_groups_of_its_envs_task_by_task() -> None:
    """What an evaluate() call's deadline is counted in (actors.faults.call_timeout_s once per group): an actor's share
    of an MT10 evaluation holds tasks interleaved, and each task's layouts run in groups of the actor's envs."""
    share = [Layout("reach-v3", 1, i) for i in range(5)] + [Layout("push-v3", 1, i) for i in range(3)] + [Layout("reach-v3", 6, 0)]
    assert episode_groups(share, 4) == 2 + 1  # reach-v3: 6 layouts in two groups of 4; push-v3: 3 in one
    assert episode_groups(share, 1) == len(share) and episode_groups(share[:4], 4) == 1 and episode_groups([], 4) == 0


def test_a_run_whose_envs_do_not_divide_among_the_tasks_is_refused(tmp_path) -> None:
    config = tiny_config(tmp_path, **{"env.task": "reach-v3,push-v3,pick-place-v3", "policy.obs_dim": 42})
    with pytest.raises(ConfigError, match=r"make 4 envs for the 3 tasks .* only with a multiple of 3"):
        preflight(config, address=None, resume=False)
    config = tiny_config(tmp_path, **{"env.task": "reach-v3,push-v3,pick-place-v3", "policy.obs_dim": 42, "actors.num_actors": 3})
    layouts = preflight(config, address=None, resume=False)
    assert [layout.task for layout in layouts] == ["reach-v3"] * 4 + ["push-v3"] * 4 + ["pick-place-v3"] * 4


def test_per_task_metrics_set_the_runs_gauges_tagged_by_task(monkeypatch) -> None:
    exporter, seen = GaugeExporter("MT10"), []

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def set(self, value: float, tags: dict) -> None:
            seen.append((self.name, value, tags))

    monkeypatch.setattr(exporter, "_gauge", lambda name, description, tag_keys: Recorder(name))
    exporter.export({"eval/success_rate": 0.5, "eval/task/reach-v3/success_rate": 0.75, "eval/task/push-v3/success_rate": 0.25})
    assert seen == [("flowrl_eval_success_rate", 0.5, {"task": "MT10"}), ("flowrl_eval_success_rate", 0.75, {"task": "reach-v3"}),
                    ("flowrl_eval_success_rate", 0.25, {"task": "push-v3"})]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "tasks"), [("mt10.yaml", list(TASK_SETS["MT10"])), ("smolvla_tiny_three_tasks.yaml", ["reach-v3", "push-v3", "pick-place-v3"])]
)
def test_the_shipped_multi_task_configs_pass_the_checks_before_a_run(name, tasks) -> None:
    config = load_config(REPO / "configs" / name)
    layouts = preflight(config, address=None, resume=False)
    assert make_suite(config.env).tasks() == tasks and [layout.task for layout in layouts] == [
        t for t in tasks for _ in range(config.eval_episodes)
    ]


def test_the_mt10_recipe_runs_on_five_other_tasks_with_no_other_change() -> None:
    """The state width is the suite's where the recipe leaves it: 39 and the one-hot of the tasks the run names."""
    others = "hammer-v3,basketball-v3,coffee-push-v3,dial-turn-v3,lever-pull-v3"
    config = load_config(REPO / "configs" / "mt10.yaml", [f"env.task={others}"])
    assert (config.policy.obs_dim, config.policy.action_dim) == (39 + 5, 4)
    layouts = preflight(config, address=None, resume=False)
    assert [layout.task for layout in layouts] == [task for task in others.split(",") for _ in range(config.eval_episodes)]
    # Set by hand, a width is kept, and checked against the suite's.
    with pytest.raises(ConfigError, match=r"policy\.obs_dim=49 but the state of the 5 tasks of .* has 44 elements: set policy\.obs_dim=44"):
        preflight(load_config(REPO / "configs" / "mt10.yaml", [f"env.task={others}", "policy.obs_dim=49"]), address=None, resume=False)


def test_a_task_the_starting_policy_solves_gets_the_solved_weight_and_a_resumed_run_keeps_its_weights(tmp_path) -> None:
    """learner.runtime.startup.with_solved_task_weights: a task whose BC held-out success (pretrain.json, per task) is above
    pretrain.target_success_max takes env.solved_task_weight, unless env.task_weights names it; a resumed run keeps the
    weights its start chose; the start line counts each task's envs; a weight for a task outside the run is refused."""
    from learner.runtime.startup import describe_task_weights, with_solved_task_weights

    checkpoint = tmp_path / "bc"
    checkpoint.mkdir()
    (checkpoint / "pretrain.json").write_text(json.dumps({"per_task": {"reach-v3": [0.95, 0.89, 0.98], "pick-place-v3": [0.7, 0.6, 0.78]}}))
    fields = {"env.task": TWO_TASKS, "policy.obs_dim": 41, "actors.num_actors": 3, "actors.envs_per_actor": 4}
    config = tiny_config(tmp_path, **fields, **{"env.solved_task_weight": 0.25})
    chosen = with_solved_task_weights(config, checkpoint, None)
    assert chosen.env.task_weights == {"reach-v3": 0.25}  # pick-place at 0.70 is not above the window's 0.7
    assert describe_task_weights(chosen).endswith("reach-v3 3, pick-place-v3 9")
    assert with_solved_task_weights(tiny_config(tmp_path, **fields), checkpoint, None).env.task_weights == {}  # weight 1.0: off
    named = tiny_config(tmp_path, **fields, **{"env.solved_task_weight": 0.25, "env.task_weights": {"reach-v3": 0.5}})
    assert with_solved_task_weights(named, checkpoint, None).env.task_weights == {"reach-v3": 0.5}
    assert with_solved_task_weights(config, None, {"pick-place-v3": 2.0}).env.task_weights == {"pick-place-v3": 2.0}
    assert describe_task_weights(tiny_config(tmp_path, **fields)) is None
    with pytest.raises(ConfigError, match=r"env.task_weights names \['push-v3'\], not tasks of env.task=reach-v3,pick-place-v3"):
        preflight(tiny_config(tmp_path, **fields, **{"env.task_weights": {"push-v3": 2.0}}), address=None, resume=False)
    with pytest.raises(ConfigError, match=r"env.solved_task_weight must be > 0, got 0"):
        tiny_config(tmp_path, **fields, **{"env.solved_task_weight": 0})


def stall_rows(rates: dict[str, list[float]], episodes: int = 20) -> list[dict]:
    """Metrics rows with each task's first-episode success on the training layouts, iteration by iteration."""
    count = len(next(iter(rates.values())))
    return [{"iteration": i + 1, **{f"rollout/task/{task}/first_episode_success_rate": values[i] for task, values in rates.items()},
             **{f"rollout/task/{task}/first_episodes": float(episodes) for task in rates}} for i in range(count)]  # fmt: skip


def test_a_task_whose_training_success_stays_inside_its_first_windows_interval_is_named_stalled() -> None:
    """Over 10-iteration windows of 20 first episodes each (200 per window): a task at 0.30 throughout stays inside its
    first window's interval (about 0.24-0.37) and is stalled; one that climbs from 0.30 to 0.60 is not; a drop is a
    move too; one that stays at 0.97 is solved, not stalled. Nothing is named before two windows have passed, nor with no window."""
    flat = [0.30] * 25
    climbing = [0.30] * 10 + [0.45] * 5 + [0.60] * 10
    falling = [0.60] * 15 + [0.30] * 10
    rows = stall_rows({"pick-place-v3": flat, "reach-v3": climbing, "push-v3": falling, "door-open-v3": [0.97] * 25})
    stalled = stalled_tasks(rows, 10)  # door-open, at 0.97 throughout, is solved: not named
    assert list(stalled) == ["pick-place-v3"]
    stall = stalled["pick-place-v3"]
    assert stall["first"] == pytest.approx(0.30) and stall["last"] == pytest.approx(0.30)
    assert stall["first_low"] < 0.30 < stall["first_high"]
    assert (stall["first_iterations"], stall["last_iterations"]) == ([1, 10], [16, 25])
    assert counts_interval(0.30 * 200, 200) == pytest.approx((stall["first"], stall["first_low"], stall["first_high"]))
    assert "pick-place-v3: training-layout success 0.30 over iterations 1-10 and 0.30 over 16-25" in describe_stall("pick-place-v3", stall)
    assert stalled_tasks(rows[:19], 10) == {} and stalled_tasks(rows, 0) == {}
    # A row whose task sampled no first episode (NaN) weighs nothing.
    rows[20]["rollout/task/reach-v3/first_episode_success_rate"], rows[20]["rollout/task/reach-v3/first_episodes"] = float("nan"), 0.0
    assert list(stalled_tasks(rows, 10)) == ["pick-place-v3"]


def test_held_against_the_previous_window_too_a_task_that_moved_and_then_stopped_is_named() -> None:
    """Windows of 20 iterations, 12 first episodes each (240 a window): a task that climbs 0.06 -> 0.17 -> 0.20 and
    then holds at 0.19 left its first window's interval, so "first" never names it; "first_or_previous" does, its last
    window inside the one before it, and says so in its line and its reason. A task still climbing a window at a time
    is named by neither, and at twice the window, where the previous window is the first, the two agree."""
    rows = stall_rows({"pick-out-of-hole-v3": [0.06] * 20 + [0.17] * 20 + [0.20] * 20 + [0.19] * 20,
                       "coffee-pull-v3": [0.30] * 20 + [0.45] * 20 + [0.60] * 20 + [0.75] * 20}, episodes=12)  # fmt: skip
    assert stalled_tasks(rows, 20) == {}
    stalled = stalled_tasks(rows, 20, "first_or_previous")
    assert list(stalled) == ["pick-out-of-hole-v3"]
    stall = stalled["pick-out-of-hole-v3"]
    assert stall["previous"] == pytest.approx(0.20) and stall["previous_iterations"] == [41, 60]
    assert (stall["previous_low"], stall["previous_high"]) == pytest.approx(counts_interval(0.20 * 240, 240)[1:])
    assert describe_stall("pick-out-of-hole-v3", stall).startswith(
        "pick-out-of-hole-v3: training-layout success 0.06 over iterations 1-20, then 0.20 over 41-60 and 0.19 over 61-80, it "
        f"moved, then stopped inside the previous window's 95% interval [{stall['previous_low']:.2f}, {stall['previous_high']:.2f}]"
    )
    initial = {task_key("pick-out-of-hole-v3", "success_rate"): 0.04}
    assert why_inside(initial, ["pick-out-of-hole-v3"], stalled, {})["pick-out-of-hole-v3"] == (
        "moved, then stalled to the end: training-layout success 0.06 over iterations 1-20, 0.20 over 41-60, 0.19 over 61-80"
    )
    assert stalled_tasks(rows[:40], 20, "first_or_previous") == stalled_tasks(rows[:40], 20) == {}
    flat = stall_rows({"pick-out-of-hole-v3": [0.06] * 40}, episodes=12)
    assert list(stalled_tasks(flat, 20, "first_or_previous")) == list(stalled_tasks(flat, 20)) == ["pick-out-of-hole-v3"]


def test_the_watch_at_an_evaluated_iteration_reads_that_iterations_row_held_for_its_evaluation(tmp_path) -> None:
    """An evaluated iteration's row waits in MetricsRows until its held-out evaluation finishes, while the watch checks
    right after the iteration: it judges the windows that end at that iteration, so what it names does not hang on how
    fast an evaluation runs. A task at 0.30 through iteration 29 that jumps to 1.00 at 30 is still, judged on the log
    alone (iterations 20-29), and moving on the rows that end at 30 (21-30: 0.37, outside 0.27-0.33)."""
    import types

    from common.metrics import MetricsLog
    from learner.runtime.reporting import MetricsRows, StallWatch

    evaluations = types.SimpleNamespace(films=None, finished=lambda evaluation: False)
    rows = MetricsRows(MetricsLog(tmp_path / "metrics.jsonl"), evaluations, types.SimpleNamespace(export_gauges=lambda row: None),
                       None, single_batch=False)  # fmt: skip
    for row in stall_rows({"pick-place-v3": [0.30] * 29 + [1.00]}, episodes=100):
        rows.add(row, types.SimpleNamespace() if row["iteration"] == 30 else None, wait=False)
    assert [row["iteration"] for row in rows.log.read()] == list(range(1, 30))  # iteration 30 waits for its evaluation
    assert [row["iteration"] for row in rows.completed()] == list(range(1, 31))
    assert StallWatch(10).check(30, rows.log.read) == ["pick-place-v3"]
    assert StallWatch(10).check(30, rows.completed) == []


def test_a_stall_named_on_a_window_too_short_to_see_a_slow_move_says_so() -> None:
    """Three first episodes an iteration over 20-iteration windows (60 a window, as a five-task LIBERO run's) leave the
    first window's interval about +-0.12 wide: a task that climbs 0.10 stays inside it and is named, and its line says
    that a move that small cannot leave it and what tells them apart. With 200 a window the same line carries no such
    note."""
    rows = stall_rows({"ketchup": [0.60] * 20 + [0.70] * 20, "bbq": [0.50] * 20 + [0.90] * 20}, episodes=3)
    stalled = stalled_tasks(rows, 20)
    assert list(stalled) == ["ketchup"] and stalled["ketchup"]["first_episodes"] == 60
    _, low, high = counts_interval(36, 60)
    assert high - 0.60 > 0.10 and low < 0.60 < 0.70 < high
    line = describe_stall("ketchup", stalled["ketchup"])
    assert line.endswith(f"(60 first episodes a window: a move under {max(high - 0.6, 0.6 - low):.2f} stays inside it, so this may "
                         "be a slow task rather than a still one; a longer stall_window tells them apart)")  # fmt: skip
    enough = stall_rows({"ketchup": [0.60] * 20 + [0.62] * 20}, episodes=10)
    assert "first episodes a window" not in describe_stall("ketchup", stalled_tasks(enough, 20)["ketchup"])


def test_a_stalled_tasks_line_shows_its_updates_figures_beside_the_moving_tasks() -> None:
    """Its first episodes' return in both windows, and the last window's mean of each figure the update logs per task,
    the stalled task's and the moving tasks' mean;
    a figure no row has (no KL reference here) is left out, and a NaN row weighs nothing."""
    rows = stall_rows({"pick-place-v3": [0.30] * 20, "reach-v3": [0.30] * 10 + [0.70] * 10, "push-v3": [0.70] * 10 + [0.30] * 10})
    for i, row in enumerate(rows):
        for task, clip, sigma in (("pick-place-v3", 0.02, 0.05), ("reach-v3", 0.2, 0.1), ("push-v3", 0.4, 0.2)):
            row[f"policy/task/{task}/clip_share"] = clip * (1 + (i % 2))  # 0.02 and 0.04 in turn: 0.03 on average
            row[f"policy/task/{task}/sigma_mean"] = sigma
        row["rollout/task/pick-place-v3/first_episode_return"] = 100.0 if i < 10 else 300.0
    rows[-1]["policy/task/pick-place-v3/sigma_mean"] = float("nan")
    stall = stalled_tasks(rows, 10)["pick-place-v3"]
    assert stall["figures"] == pytest.approx({"clip share": 0.03, "sigma": 0.05})
    assert stall["moving_figures"] == pytest.approx({"clip share": 0.45, "sigma": 0.15})
    line = describe_stall("pick-place-v3", stall)
    assert line.endswith(
        "; first-episode return 100 -> 300; its update over the last window (the moving tasks' mean): clip share 0.03 "
        "(0.45), sigma 0.05 (0.15)"
    )


def test_each_task_left_inside_its_initial_interval_is_given_its_reason() -> None:
    """A task solved at the start, one stalled to the end (demonstrations given after its stall), one given
    demonstrations that moved since, and one that moved alone: each with its reason, in the order given."""
    initial = {task_key(task, "success_rate"): rate for task, rate in {"a": 0.97, "b": 0.30, "c": 0.40, "d": 0.50}.items()}
    stalled = {"b": {"first": 0.30, "last": 0.31, "first_iterations": [1, 20], "last_iterations": [81, 100]}}
    reasons = why_inside(initial, ["a", "b", "c", "d"], stalled, {"b": 41, "c": 41})
    assert list(reasons) == ["a", "b", "c", "d"]
    assert reasons["a"] == "solved at the start (0.97)"
    assert reasons["b"] == ("stalled to the end: training-layout success 0.30 over iterations 1-20, 0.31 over 81-100; "
                            "demonstrations from iteration 41 (algorithm.stall_demos)")  # fmt: skip
    moved = "its training-layout success left its first window, its held-out success not its initial interval"
    assert reasons["c"] == moved + "; demonstrations from iteration 41 (algorithm.stall_demos)" and reasons["d"] == moved


def test_the_demonstrations_a_run_learnt_from_count_its_starts_and_a_stalled_tasks(tmp_path) -> None:
    """What a run's gain is set beside: cloning the demonstrations it learnt from alone. Its start's counts come from the
    start's pretrain.json; a stalled task's demonstrations are the first layouts of the same seed, so its count is the
    larger; a start cloned from a dataset (or not cloned here) gives none."""
    from learner.runtime.reporting import demonstrations_used

    config = load_config(REPO / "configs" / "mt10.yaml")
    start = tmp_path / "bc"
    start.mkdir()
    counts = {"reach-v3": 2, "push-v3": 2, "door-open-v3": 1}
    (start / "pretrain.json").write_text(json.dumps({"demos": 5, "demos_per_task": counts, "config": {"pretrain": {"dataset": ""}}}))
    assert demonstrations_used(start, config, {}) == counts
    assert demonstrations_used(start, config, {"push-v3": 41, "door-open-v3": 81}) == {"reach-v3": 2, "push-v3": 10, "door-open-v3": 10}
    single = load_config(None)
    (start / "pretrain.json").write_text(json.dumps({"demos": 5, "config": {"pretrain": {"dataset": ""}}}))
    assert demonstrations_used(start, single, {}) == {"pick-place-v3": 5}
    (start / "pretrain.json").write_text(json.dumps({"demos": 5, "config": {"pretrain": {"dataset": "datasets/pick"}}}))
    assert demonstrations_used(start, single, {}) is None
    assert demonstrations_used(tmp_path / "lerobot_start", single, {}) is None
