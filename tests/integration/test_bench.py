"""Smoke runs of the bench/ scripts that need no Ray, at their smallest sizes: the output parses, every figure is
positive and finite, and each ratio printed is the quotient of the two figures it compares (also in the `name: value`
lines). The SmolVLA bench runs the full-size path with the tiny VLM on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from bench import (
    actors_per_gpu,
    compile_cache,
    env_step,
    frame_cost,
    libero_experts,
    libero_step,
    overhead,
    rllib_ppo,
    smolvla_gpu,
)
from bench.report import flatten
from common.config import RunConfig
from tests.conftest import REPO
from tests.helpers.bench_output import TINY_MAIN_ARGS, assert_positive, printed


def test_overheads_fingerprint_repeats_for_the_same_job_and_changes_with_any_bit_of_it(capsys):
    """The fingerprint that checks a speed-up left the job's bits as they were: equal for a rerun, different for a
    run whose rollouts differ (another seed) and for one whose first rollouts match but whose updates differ (another
    learning rate)."""
    tiny = ["--iterations", "2", "--warmup-iterations", "0", "--in-process-only", "--main-arg=--num-actors=2",
            *(f"--main-arg={arg}" for arg in TINY_MAIN_ARGS)]  # fmt: skip
    fingerprints = [
        overhead.main([*tiny, *extra])["in_process_fingerprint"]
        for extra in ([], [], ["--main-arg=--seed=1"], ["--main-arg=--set=algorithm.actor_lr=0.0002"])
    ]
    capsys.readouterr()
    assert fingerprints[0] == fingerprints[1]
    assert len(set(fingerprints)) == 3


def test_env_step_smallest_compares_both_variants_on_both_kinds_of_actions(capsys):
    results = env_step.main(["--envs", "2", "--seconds", "0.2", "--rounds", "1"])
    assert printed(capsys) == json.loads(json.dumps(results))
    for kind in ("random", "expert"):
        assert_positive(results[f"{kind}_metaworld_us_per_step"], results[f"{kind}_project_us_per_step"])
        assert results[f"{kind}_project_over_metaworld"] == pytest.approx(
            results[f"{kind}_project_us_per_step"] / results[f"{kind}_metaworld_us_per_step"], rel=1e-12
        )
    for variant in ("metaworld", "project"):
        assert results[f"expert_over_random_{variant}"] == pytest.approx(
            results[f"expert_{variant}_us_per_step"] / results[f"random_{variant}_us_per_step"], rel=1e-12
        )


def test_frame_cost_smallest_prices_both_drawings_and_how_far_apart_they_are(capsys):
    results = frame_cost.main(["--sizes", "48", "--frames", "2", "--rounds", "1", "--resized", "16"])
    assert printed(capsys) == json.loads(json.dumps(results))
    assert_positive(results["48_fast_ms_per_frame"], results["48_default_ms_per_frame"])
    assert results["48_default_over_fast"] == pytest.approx(results["48_default_ms_per_frame"] / results["48_fast_ms_per_frame"], rel=1e-12)
    assert 0 < results["48_fast_pixels_differ"] <= 1 and results["48_fast_mean_abs_diff"] > 0  # shadows, at the least
    assert 0 < results["48_fast_resized_16_mean_abs_diff"] < 255


def test_libero_step_smallest_prices_a_state_step_each_render_and_a_reset(capsys):
    results = libero_step.main(["--sizes", "32", "--decisions", "1", "--rounds", "1"])
    assert printed(capsys) == json.loads(json.dumps(results))
    assert_positive(results["state_ms_per_step"], results["32px_render_ms"], results["32px_shadows_render_ms"], results["reset_ms"])
    assert results["32px_ms_per_decision"] == pytest.approx(4 * results["32px_ms_per_step"], rel=1e-12)  # one render per 4 steps
    assert results["32px_ms_per_decision"] > results["32px_render_ms"]


def test_libero_experts_scores_each_task_and_lists_one_without_an_expert(capsys):
    soup, drawer = "pick_up_the_alphabet_soup_and_place_it_in_the_basket", "open_the_middle_drawer_of_the_cabinet"
    results = libero_experts.main(["--benchmark", f"{soup},{drawer}", "--episodes", "1"])
    out = capsys.readouterr().out
    figures = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert figures["tasks"] == json.loads(json.dumps(results))
    assert results[drawer] == {"expert": False} and f"| {drawer} | no expert | - |" in out
    assert (results[soup]["successes"], results[soup]["episodes"], figures["successes"], figures["episodes"]) == (1, 1, 1, 1)
    assert results[soup]["failed_init_states"] == [] and 0 < results[soup]["mean_steps"] < 280


def test_rllib_env_draws_a_training_layout_at_every_reset_from_its_seed():
    # The env RLlib's runners build (bench/rllib_ppo.py), checked here without RLlib: the project's env has none.
    assert "ray.rllib" not in sys.modules  # importing the bench module did not import RLlib
    config = RunConfig().env
    train = {(seed, index) for seed in config.train_benchmark_seeds for index in range(50)}

    def layout_sequence(env: rllib_ppo.TrainingLayoutEnv, resets: int) -> list[tuple[int, int]]:
        drawn = []
        for _ in range(resets):
            observation, info = env.reset()
            assert observation.shape == (39,) and observation.dtype == np.float32
            drawn.append((info["benchmark_seed"], info["layout_index"]))
            assert drawn[-1] == (env.layout.benchmark_seed, env.layout.index)
            done = False
            while not done:  # an episode to its end (5 steps), then the next reset
                observation, reward, terminated, truncated, info = env.step(env.action_space.sample())
                assert observation.shape == (39,) and set(info) == {"success"}
                done = terminated or truncated
        return drawn

    envs = [rllib_ppo.make_env({"seed": seed, "max_episode_steps": 5}) for seed in (3, 3, 4)]
    try:
        assert envs[0].action_space.shape == (4,) and envs[0].observation_space.shape == (39,)
        first, again, other = (layout_sequence(env, 6) for env in envs)
        assert first == again  # the same seed draws the same layouts
        assert first != other
        assert len(set(first)) > 1 and set(first + other) <= train  # a new training layout after each episode
        envs[1].reset(seed=3)  # a reset's seed restarts the sequence with that seed
        assert layout_sequence(envs[1], 5) == first[1:]
        # RLlib's runners tell their envs apart by worker index: the same seed on another runner draws other layouts.
        runner_two = rllib_ppo.make_env({"seed": 3, "max_episode_steps": 5, "worker_index": 2})
        assert layout_sequence(runner_two, 6) != first
        runner_two.close()
    finally:
        for env in envs:
            env.close()


def test_smolvla_gpu_bench_runs_every_stage_at_test_size(capsys):
    """The full-size SmolVLA bench's path with the tiny VLM on CPU: the stand-in checkpoint loads strictly, the ratio
    check passes, the scoring pass encodes by micro-batch (and, asked, the whole batch at once), version 1 reaches
    the actor."""
    assert smolvla_gpu.main(["--size", "tiny", "--rollouts", "2", "--batch-sizes", "1,2", "--prepare-whole-batch"]) == 0
    results = printed(capsys)
    assert not [name for name, value in flatten(results).items() if name.endswith("/error")]
    assert results["build"]["trainable_parameters"] < results["build"]["parameters"]  # the VLM is frozen
    assert results["update"]["decisions"] == 2 * 2 and results["update"]["ppo/first_minibatch_ratio_dev"] <= 1e-5
    assert results["update"]["ppo/actor_lr"] > 0  # an update that trains the actor, not the recipe's critic warm-up
    assert 0 < results["update"]["scoring_pass_seconds"] < results["update"]["seconds"]  # the update times its own scoring pass
    assert (results["prepare"]["rows_per_encode"], results["prepare_whole_batch"]["rows_per_encode"]) == (2, 4)
    assert results["publish_load_sample_v1"]["version"] == 1
    latency = results["decision_latency"]
    # On CPU the eager path alone, with the host's op count per decision (a CUDA graph replays them in one launch); no
    # launches to count (the profiler runs on a GPU only).
    assert latency["eager_batch2_aten_ops"] > latency["eager_batch1_aten_ops"] > 1000 and "eager_batch1_kernel_launches" not in latency
    assert not [name for name in latency if name.startswith("graph_")]
    # FLOPs: every env's decision is the same arithmetic; the vision tower is part of the encode, the encode of the decision.
    assert latency["batch2_flops"] == 2 * latency["batch1_flops"]
    assert 0 < latency["batch1_vision_flops"] < latency["batch1_encode_flops"] < latency["batch1_flops"]
    assert 0 < latency["batch1_encode_aten_ops"] < latency["eager_batch1_aten_ops"]  # the denoising steps dispatch the rest
    assert 0 < results["update"]["vision_flops"] <= results["update"]["scoring_pass_flops"] < results["update"]["flops"]
    assert_positive(latency["eager_batch1_seconds"], results["sample_v0"]["env_steps_per_second"],
                    results["publish_load_sample_v1"]["rollout_env_steps_per_second"])  # fmt: skip


def test_smolvla_gpu_bench_times_the_compiled_steps_and_vision_beside_the_eager_ones(capsys):
    """--compile-steps: each decision path again with its denoising steps compiled, its steps dispatching under a
    quarter of the eager steps' ATen ops; --compile-vision: again with the vision tower compiled too, its encode
    dispatching fewer ops still; --fused-attention: every path again with SmolVLA's attention in one kernel. With a
    float32 actor all give the eager path's outputs on the same noise within float rounding."""
    torch._dynamo.reset()  # compiles of other tests' policies count towards the step's recompile limit
    argv = ["--size", "tiny", "--rollouts", "1", "--batch-sizes", "2", "--compile-steps", "--compile-vision", "--fused-attention",
            "--set", "actors.speed.precision=float32", "--skip", "prepare,publish_load_sample_v1"]  # fmt: skip
    assert smolvla_gpu.main(argv) == 0
    latency = printed(capsys)["decision_latency"]
    assert not [name for name in latency if name.startswith("graph") or name.endswith("_error")]  # no graphs on CPU
    encode_ops = latency["batch2_encode_aten_ops"]
    assert 0 < latency["eager_compiled_batch2_aten_ops"] - encode_ops < (latency["eager_batch2_aten_ops"] - encode_ops) / 4
    assert 0 < latency["eager_compiled_vision_batch2_aten_ops"] < latency["eager_compiled_batch2_aten_ops"]  # the tower's fused
    assert latency["eager_compiled_batch2_generated_kernels"] > 0 and latency["eager_compiled_vision_batch2_generated_kernels"] > 0
    for path in ("eager_compiled", "eager_compiled_vision"):
        assert latency[f"{path}_batch2_first_call_seconds"] > latency[f"{path}_batch2_seconds"] > 0  # the compile
    for path in ("eager_compiled", "eager_compiled_vision", "eager_fused", "eager_compiled_fused", "eager_compiled_vision_fused"):
        for name in ("chain", "log_prob_per_element"):
            assert latency[f"{path}_vs_eager_batch2_max_abs_{name}"] <= 1e-5
    assert latency["eager_compiled_speedup_batch2"] > 0 and latency["eager_compiled_vision_speedup_batch2"] > 0
    for path in ("eager", "eager_compiled", "eager_compiled_vision"):  # each path against itself with the attention fused
        assert latency[f"{path}_fused_speedup_batch2"] > 0
    assert 0 < latency["eager_fused_batch2_aten_ops"] < latency["eager_batch2_aten_ops"]  # one op where eager dispatches several


def test_an_actor_started_over_a_filled_compile_cache_compiles_nothing_again(capsys):
    """bench/compile_cache.py: a second actor process over the compile cache the first one filled loads every compiled
    graph of the project's compiled denoising step (FX graph cache hits, no miss) instead of compiling it again, and
    its first rollout is the shorter for it."""
    assert compile_cache.main(["--set", "actors.speed.compile_vision=false"]) == 0
    results = printed(capsys)
    cold, warm = results["cold"], results["warm"]
    assert cold["fxgraph_cache_miss"] > 0 and cold["fxgraph_cache_hit"] == 0
    assert warm["fxgraph_cache_miss"] == 0 and warm["fxgraph_cache_hit"] == cold["fxgraph_cache_miss"]
    assert_positive(cold["compile_seconds"], warm["first_rollout_seconds"], warm["second_rollout_seconds"])
    assert results["warm_over_cold_compile"] == warm["compile_seconds"] / cold["compile_seconds"]


def test_the_prepared_gpu_check_runs_its_parts_at_test_size_and_writes_each_report(tmp_path):
    """bench/gpu_check.sh --tiny, the SmolVLA part: one report with the update and its two variants (the fused attention,
    the actors' tokens) and the group path with one rank against the learner alone (a one-process gloo group, no Ray)
    on the same rollouts: the same weights within the learner group tests' tolerance, the same bytes held, and the ratio
    of their median times."""
    environment = {**os.environ, "REPORT_DIR": str(tmp_path), "GPU_CHECK_PARTS": "smolvla", "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "--tiny"], env=environment, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, (tmp_path / "gpu_check.log").read_text()[-3000:]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["gpu_check.log", "smolvla.txt"]
    lines = (tmp_path / "smolvla.txt").read_text().splitlines()
    results = json.loads(lines[0])
    assert not [name for name, value in flatten(results).items() if name.endswith("/error")]
    assert len(lines) == 1 + len(flatten(results))  # then every figure as a `name: value` line
    group, update = results["group_of_one"], results["update"]
    assert group["max_abs_weight_difference"] <= 1e-5 and group["ppo/first_minibatch_ratio_dev"] <= 1e-5
    assert group["over_alone"] == group["group_seconds"] / group["alone_seconds"] and group["turns"] == 1
    for name in ("parameter_bytes", "gradient_bytes", "optimizer_bytes"):
        assert group[name] == update[name] > 0
    assert update["parameter_bytes"] > update["gradient_bytes"]  # only the trainable weights have gradients
    for variant in ("learner.speed.fused_attention=true", "actors.speed.send_image_embeddings=true"):
        assert results[f"update[{variant}]"]["ppo/first_minibatch_ratio_dev"] <= 1e-5
    assert results["update[actors.speed.send_image_embeddings=true]"]["sample_record_bytes_per_decision"] > 0
    assert "eager_fused_batch2_seconds" in results["decision_latency"]


def test_actors_sharing_a_device_each_sample_every_timed_rollout_and_the_rates_are_set_against_one_actor(capsys):
    """bench/actors_per_gpu.py: each count's actors run as processes of their own, released together; every actor's
    timed rollouts are counted (envs x decisions x rollouts each), and the ratios are the counts' rates over one actor's."""
    assert actors_per_gpu.main(["--actors", "2,1", "--rollouts", "2", "--warmup", "1"]) == 0
    results = printed(capsys)
    per_actor = results["envs_per_actor"] * results["decisions_per_rollout"] * 2
    for count in (1, 2):
        figures = results[f"actors_{count}"]
        assert figures["decisions"] == count * per_actor and figures["actor_device"] == "cpu"
        assert figures["decisions_per_second"] == figures["decisions"] / figures["seconds"]
        assert_positive(figures["env_steps_per_second"], figures["rollout_seconds"], figures["construct_seconds"])
        assert figures["rollout_seconds"] <= figures["seconds"]  # the window holds each actor's rollouts
    one, two = results["actors_1"]["decisions_per_second"], results["actors_2"]["decisions_per_second"]
    assert results["decisions_per_second_ratio_2_to_1"] == two / one
    assert results["most_decisions_per_second_at"] in (1, 2)


@pytest.mark.parametrize("counts", ["2,4", "0,1", "1,two"])
def test_actor_counts_without_one_or_not_whole_numbers_are_refused_before_anything_starts(counts, capsys):
    with pytest.raises(SystemExit) as exit_info:
        actors_per_gpu.main(["--actors", counts])
    assert exit_info.value.code == 2 and f"--actors {counts}" in capsys.readouterr().err


def test_smolvla_gpu_bench_updates_again_by_a_fresh_learner_per_variant_with_the_last_one_gone(capsys, monkeypatch):
    """--update-variants: each variant's learner updates on the same rollouts, and is built after the previous learner
    is gone, whose memory would otherwise count in the variant's peak; a variant of the actors samples rollouts of its own."""
    import weakref

    from learner.update import learner as learner_module

    built, alive_at_build = [], []

    class Counted(learner_module.Learner):
        def __init__(self, *args, **kwargs):
            alive_at_build.append(sum(ref() is not None for ref in built))
            super().__init__(*args, **kwargs)
            built.append(weakref.ref(self))

    monkeypatch.setattr(learner_module, "Learner", Counted)
    compiled = "learner.speed.steps_in_one_pass=true,learner.speed.compile_steps=true"
    sent = "actors.speed.send_image_embeddings=true"
    variants = (f"learner.speed.recompute_steps=true;algorithm.grad_accum=1;learner.speed.steps_in_one_pass=true;{compiled};"
                f"learner.speed.fused_attention=true;{sent}")  # fmt: skip
    step_by_step = ["--set", "learner.speed.precision=float32", "--set", "learner.speed.steps_in_one_pass=false"]  # the variants' base
    argv = ["--size", "tiny", "--rollouts", "2", "--skip", "decision_latency,prepare,publish_load_sample_v1", *step_by_step,
            "--update-variants", variants]  # fmt: skip
    assert smolvla_gpu.main(argv) == 0
    results = printed(capsys)
    assert not [name for name, value in flatten(results).items() if name.endswith("/error")]
    assert alive_at_build == [0, 0, 0, 0, 0, 0, 0, 0]  # the main learner, then one per variant (two for the compiled one)
    for name in (
        "update",
        "update[learner.speed.recompute_steps=true]",
        "update[algorithm.grad_accum=1]",
        "update[learner.speed.steps_in_one_pass=true]",
        f"update[{compiled}]",
        "update[learner.speed.fused_attention=true]",
        f"update[{sent}]",
    ):
        assert results[name]["decisions"] == 2 * 2 and results[name]["ppo/first_minibatch_ratio_dev"] <= 1e-5
    recomputed = results["update[learner.speed.recompute_steps=true]"]
    cost = ("aten_ops", "flops", "saved_for_backward_peak_bytes")  # not the work's result
    numbers = [key for key in results["update"] if "seconds" not in key and not key.endswith(cost)]
    assert {key: recomputed[key] for key in numbers} == {key: results["update"][key] for key in numbers}  # not a bit changed
    assert 0 < results["update[learner.speed.steps_in_one_pass=true]"]["aten_ops"] < results["update"]["aten_ops"]  # CPU: ops counted
    # Activations held for the backward passes: fewer with the steps recomputed there, fewer without the float32 scores.
    saved = {name: figures.get("saved_for_backward_peak_bytes") for name, figures in results.items() if name.startswith("update")}
    assert saved[f"update[{compiled}]"] is None and saved["update"] > 0  # a compiled backward keeps its own
    assert saved["update[learner.speed.recompute_steps=true]"] < saved["update"]
    assert saved["update[learner.speed.fused_attention=true]"] < saved["update"]
    # The actors' vision-tower tokens in place of the frames: rollouts of their own, the vision tower over the next
    # observations no decision read alone, and the learner scoring on the bfloat16 actor's own tokens.
    tokens, frames = results[f"update[{sent}]"], results["update"]
    assert tokens["sample_rollouts"] == 2
    assert tokens["sample_record_bytes_per_decision"] != results["sample_v0"]["record_bytes_per_decision"]
    assert 0 < tokens["vision_flops"] < frames["vision_flops"]
    assert frames["flops"] - tokens["flops"] >= frames["vision_flops"] - tokens["vision_flops"]  # the tower and its connector
    assert tokens["logprob/behaviour_gap_max"] < frames["logprob/behaviour_gap_max"]
    # The compiled steps: compiled by an update of their own, then timed with no new graph and fewer ops dispatched.
    assert results[f"update[{compiled}]"]["first_update_seconds"] > 0 and results[f"update[{compiled}]"]["graphs_compiled"] == 0
    assert 0 < results[f"update[{compiled}]"]["aten_ops"] < results["update[learner.speed.steps_in_one_pass=true]"]["aten_ops"]
