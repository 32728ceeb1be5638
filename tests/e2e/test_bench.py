"""Smoke runs of the bench/ scripts that run Ray (each its own), at their smallest sizes: the output parses, every
figure is positive and finite, and each ratio printed is the quotient of the two figures it compares."""

from __future__ import annotations

import json

import pytest

from bench import broadcast, learner_scaling, overhead, startup, throughput
from common.policy import FlowPolicy
from tests.helpers.bench_output import TINY_MAIN_ARGS, assert_positive, printed

pytestmark = pytest.mark.usefixtures("no_ray")


def test_broadcast_smallest(capsys):
    results = broadcast.main(["--actors", "1,2", "--sizes", "1MB", "--repeats", "2"])
    assert printed(capsys) == json.loads(json.dumps(results))
    assert set(results["cases"]) == {"n1_1MB", "n2_1MB"}
    for case in results["cases"].values():
        assert case["payload_bytes"] == 10**6
        assert_positive(case["floor_seconds"], case["project_seconds"], case["state_dict_seconds"])
        for path in ("project", "state_dict"):
            assert case[f"{path}_ratio_to_floor"] == pytest.approx(case["floor_seconds"] / case[f"{path}_seconds"], rel=1e-12)


def test_startup_smallest(capsys):
    results = startup.main(["--actors", "2", *(f"--main-arg={arg}" for arg in TINY_MAIN_ARGS)])
    assert printed(capsys) == json.loads(json.dumps(results))
    assert_positive(results["command_to_first_rollout_seconds"], results["floor_seconds"], results["first_rollout_sample_seconds"])
    assert results["command_to_first_rollout_seconds"] < results["command_to_first_metrics_row_seconds"] <= results["command_seconds"]
    assert results["ratio_to_floor"] == pytest.approx(results["command_to_first_rollout_seconds"] / results["floor_seconds"], rel=1e-12)
    main_stages, floor = results["main_stages"], results["floor_stages"]
    assert 0 < main_stages["ray_up"] < main_stages["weights_published"] < main_stages["first_rollout"] < results["command_seconds"]
    assert "initial_evaluation" not in main_stages  # --single-batch: its start-up has no evaluation in it
    assert results["main_console_lines_before_its_own"] == 0  # the project's line comes first, before Ray's
    assert results["main_console_error_lines"] == 0  # a healthy run prints no error-level line
    assert 0 < floor["ray_up"] < floor["actors_ready"] == results["floor_seconds"]
    assert results["ray_up_ratio"] == pytest.approx(main_stages["ray_up"] / floor["ray_up"], rel=1e-12)
    after_ray = (main_stages["first_rollout"] - main_stages["ray_up"]) / (floor["actors_ready"] - floor["ray_up"])
    assert results["after_ray_ratio"] == pytest.approx(after_ray, rel=1e-12)
    main_cpu, floor_cpu = results["main_cpu_seconds"], results["floor_cpu_seconds"]
    assert_positive(main_cpu["actors"], main_cpu["learner"], main_cpu["driver"], floor_cpu["actors"], floor_cpu["driver"])
    assert floor_cpu["learner"] == 0.0  # the floor has no learner
    for cpu in (main_cpu, floor_cpu):
        assert cpu["total"] == pytest.approx(sum(v for k, v in cpu.items() if k != "total"), rel=1e-12)
    assert results["cpu_ratio_to_floor"] == pytest.approx(main_cpu["total"] / floor_cpu["total"], rel=1e-12)


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
        shares = [results[f"lag{lag}_main_{part}_cpu_share"] for part in ("env", "policy", "update")]
        assert all(0 < share < 1 for share in shares) and sum(shares) == pytest.approx(1.0)
    quotient = results["lag1_main_env_steps_per_second"] / results["lag0_main_env_steps_per_second"]
    assert results["lag1_over_lag0"] == pytest.approx(quotient, rel=1e-12)


def test_overhead_smallest_replays_the_ray_run_in_one_process(capsys):
    results = overhead.main(
        ["--iterations", "2", "--warmup-iterations", "1", "--main-arg=--num-actors=2", *(f"--main-arg={arg}" for arg in TINY_MAIN_ARGS)]
    )
    assert printed(capsys) == json.loads(json.dumps(results))
    assert results["same_final_weights"] == 1  # the same rollouts and updates, with and without Ray
    assert len(results["in_process_fingerprint"]) == 64
    assert_positive(results["ray_median_iteration_seconds"], results["in_process_median_iteration_seconds"])
    assert results["ray_share"] < 1
    assert results["in_process_over_ray"] == pytest.approx(
        results["in_process_median_iteration_seconds"] / results["ray_median_iteration_seconds"], rel=1e-12
    )


def test_learner_scaling_smallest_times_the_learner_alone_and_two_ranks(capsys, bc_checkpoint):
    results = learner_scaling.main(["--ranks", "1,2", "--repeats", "1", "--warmup", "0", "--actors", "2", "--envs-per-actor", "1",
                                    "--decisions", "4", "--all-reduce-calls", "2", "--checkpoint", str(bc_checkpoint)])  # fmt: skip
    assert printed(capsys) == json.loads(json.dumps(results))  # every figure also a `name: value` line
    assert results["decisions_per_update"] == 2 * 1 * 4
    trainable = sum(p.numel() for p in FlowPolicy.from_pretrained(bc_checkpoint).parameters() if p.requires_grad)
    assert results["trainable_parameters"] == trainable  # what the all-reduce timed is the size of
    assert_positive(results["all_reduce_seconds_2"], results["optimizer_steps_per_update"])
    for size in (1, 2):
        assert_positive(results[f"update_seconds_{size}"], results[f"update_wall_seconds_{size}"])
    for name in ("update_seconds", "update_wall_seconds"):
        assert results[f"{name}_ratio_2_to_1"] == pytest.approx(results[f"{name}_2"] / results[f"{name}_1"], rel=1e-12)
    steps_times_all_reduce = results["optimizer_steps_per_update"] * results["all_reduce_seconds_2"]
    assert results["all_reduce_share_of_update_2"] == pytest.approx(steps_times_all_reduce / results["update_seconds_2"], rel=1e-12)
    assert results["rank_state_bytes_ratio_2_to_1"] == 1.0  # unsharded: each rank holds what the learner alone holds


def test_learner_scaling_sharded_ranks_each_hold_about_half_of_the_learner_alone_s_state(capsys, bc_checkpoint):
    results = learner_scaling.main(["--ranks", "1,2", "--repeats", "1", "--warmup", "0", "--actors", "2", "--envs-per-actor", "1",
                                    "--decisions", "4", "--sharding", "fsdp", "--checkpoint", str(bc_checkpoint)])  # fmt: skip
    assert printed(capsys) == json.loads(json.dumps(results))
    parameters = sum(p.numel() * p.element_size() for p in FlowPolicy.from_pretrained(bc_checkpoint).parameters())
    assert results["rank_parameter_bytes_1"] == parameters
    assert results["rank_state_bytes_ratio_2_to_1"] == pytest.approx(0.5, rel=0.05)
    assert "all_reduce_seconds_2" not in results  # a sharded group's gradients are reduced in its backward passes
