"""Smoke runs of the bench/ scripts at their smallest sizes: the output parses, every figure is positive and
finite, and each ratio printed is the quotient of the two figures it compares (also in the `name: value` lines)."""

from __future__ import annotations

import json
import math

import pytest

from bench import broadcast, overhead, recompute, startup, throughput
from bench.report import flatten

# learner.main with a random policy and a few decisions: the start-up is the cost, not the work.
TINY_MAIN_ARGS = ["--allow-random-init", "--set=actors.envs_per_actor=2", "--set=actors.decisions_per_rollout=3",
                  "--set=env.max_episode_steps=20", "--set=learner.minibatch_size=6", "--set=learner.update_epochs=1",
                  "--set=learner.critic_warmup_iters=0", "--set=policy.hidden_dim=32", "--set=policy.num_layers=1",
                  "--set=checkpoint_every=100"]  # fmt: skip


def printed(capsys) -> dict:
    """The JSON object a bench printed, checked against its `name: value` lines."""
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    results = json.loads(next(line for line in lines if line.startswith("{")))
    named = dict(line.split(": ", 1) for line in lines if not line.startswith("{"))
    flat = flatten(results)
    assert set(named) == set(flat)
    for name, value in flat.items():
        assert named[name] == str(value), name
    return results


def assert_positive(*values: float) -> None:
    for value in values:
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, value


def test_payload_shapes_sum_to_the_size_asked():
    shapes = broadcast.synthetic_shapes(broadcast.parse_size("70MB"))
    assert sum(math.prod(shape) for shape in shapes.values()) * 4 == 70 * 10**6
    assert max(math.prod(shape) for shape in shapes.values()) <= broadcast.MAX_TENSOR_ELEMENTS
    with pytest.raises(SystemExit, match="10 MB"):
        broadcast.parse_size("10 MB")


@pytest.mark.slow
def test_broadcast_smallest(capsys):
    results = broadcast.main(["--actors", "1,2", "--sizes", "1MB", "--repeats", "2"])
    assert printed(capsys) == json.loads(json.dumps(results))
    assert set(results["cases"]) == {"n1_1MB", "n2_1MB"}
    for case in results["cases"].values():
        assert case["payload_bytes"] == 10**6
        assert_positive(case["floor_seconds"], case["project_seconds"], case["state_dict_seconds"])
        for path in ("project", "state_dict"):
            assert case[f"{path}_ratio_to_floor"] == pytest.approx(case["floor_seconds"] / case[f"{path}_seconds"], rel=1e-12)


@pytest.mark.slow
def test_startup_smallest(capsys):
    results = startup.main(["--actors", "2", *(f"--main-arg={arg}" for arg in TINY_MAIN_ARGS)])
    assert printed(capsys) == json.loads(json.dumps(results))
    assert_positive(results["command_to_first_rollout_seconds"], results["floor_seconds"], results["first_rollout_sample_seconds"])
    assert results["command_to_first_rollout_seconds"] < results["command_to_first_metrics_row_seconds"] <= results["command_seconds"]
    assert results["ratio_to_floor"] == pytest.approx(results["command_to_first_rollout_seconds"] / results["floor_seconds"], rel=1e-12)


@pytest.mark.slow
def test_throughput_smallest(capsys):
    args = ["--iterations", "2", "--warmup-iterations", "1", "--env-seconds", "1", "--eval-episodes", "2", "--processes", "1",
            "--matched-processes", "2", "--policy-lags", "0,1"]  # fmt: skip
    results = throughput.main(args + [f"--main-arg={arg}" for arg in ["--num-actors=2", *TINY_MAIN_ARGS]])
    assert printed(capsys) == json.loads(json.dumps(results))
    assert results["env_limit_processes"] == 1 and results["env_limit_env_steps"] > 0
    assert results["matched_env_limit_processes"] == 2 and results["matched_env_limit_env_steps"] > 0
    for lag in (0, 1):
        assert results[f"lag{lag}_main_iterations_timed"] == 1
        speed = results[f"lag{lag}_main_env_steps_per_second"]
        assert_positive(speed, results["env_limit_steps_per_second"], results[f"lag{lag}_main_median_iteration_seconds"])
        for limit in ("env_limit", "matched_env_limit"):
            assert results[f"lag{lag}_ratio_to_{limit}"] == pytest.approx(speed / results[f"{limit}_steps_per_second"], rel=1e-12)
    quotient = results["lag1_main_env_steps_per_second"] / results["lag0_main_env_steps_per_second"]
    assert results["lag1_over_lag0"] == pytest.approx(quotient, rel=1e-12)


@pytest.mark.slow
def test_overhead_smallest_replays_the_ray_run_in_one_process(capsys):
    results = overhead.main(
        ["--iterations", "2", "--warmup-iterations", "1", "--main-arg=--num-actors=2", *(f"--main-arg={arg}" for arg in TINY_MAIN_ARGS)]
    )
    assert printed(capsys) == json.loads(json.dumps(results))
    assert results["same_final_weights"] == 1  # the same rollouts and updates, with and without Ray
    assert_positive(results["ray_median_iteration_seconds"], results["in_process_median_iteration_seconds"])
    assert results["ray_share"] < 1
    assert results["in_process_over_ray"] == pytest.approx(
        results["in_process_median_iteration_seconds"] / results["ray_median_iteration_seconds"], rel=1e-12
    )


def test_recompute_smallest_plots_and_prints_each_case(capsys, tmp_path):
    results = recompute.main(["--repeats", "1", "--steps", "2,4", "--horizons", "4", "--batches", "20", "--plot", str(tmp_path / "r.png")])
    assert printed(capsys) == json.loads(json.dumps(results))
    assert set(results["cases"]) == {"K2_H4_B500", "K4_H4_B500", "K4_H4_B20"}
    for case in results["cases"].values():
        assert_positive(case["sample_seconds"], case["recompute_seconds"], case["train_seconds"])
        assert case["recompute_over_sample"] == pytest.approx(case["recompute_seconds"] / case["sample_seconds"], rel=1e-12)
        assert case["train_over_sample"] == pytest.approx(case["train_seconds"] / case["sample_seconds"], rel=1e-12)
    assert (tmp_path / "r.png").stat().st_size > 1000
