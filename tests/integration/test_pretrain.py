"""Behaviour-cloning pre-training: the loss falls, the checkpoint round-trips, the cache is keyed by config."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from common.config import ConfigError
from common.demonstrations import Episode
from common.policy import FlowPolicy, build_policy
from common.suites import Layout
from learner.bc.starting_checkpoint import bc_cache_key, ensure_bc_checkpoint
from learner.bc.training import REPORT_FILE, chunk_dataset, demo_counts, pretrain
from tests.conftest import tiny_config


def test_chunk_dataset_pads_with_the_last_action() -> None:
    actions = np.arange(3 * 2, dtype=np.float32).reshape(3, 2)
    episode = Episode(np.zeros((3, 5), np.float32), actions, True, Layout("pick-place-v3", 0, 0))
    obs, chunks = chunk_dataset([episode], chunk_size=4)
    assert obs.shape == (3, 5) and chunks.shape == (3, 4, 2)
    np.testing.assert_array_equal(chunks[0], actions[[0, 1, 2, 2]])
    np.testing.assert_array_equal(chunks[2], actions[[2, 2, 2, 2]])


def test_short_pretraining_reduces_the_loss_and_round_trips(tmp_path) -> None:
    config = tiny_config(tmp_path, **{"pretrain.train_steps": 800, "pretrain.eval_episodes": 3})
    report = pretrain(config, tmp_path / "bc", progress=False)
    assert report["loss_last_100"] < 0.6 * report["loss_first_100"]
    assert report["eval_episodes"] == 3 and 0.0 <= report["eval_success_rate"] <= 1.0
    assert json.loads((tmp_path / "bc" / REPORT_FILE).read_text())["demos"] == 2
    first = FlowPolicy.from_pretrained(tmp_path / "bc")
    first.save_pretrained(tmp_path / "again")
    second = FlowPolicy.from_pretrained(tmp_path / "again")
    for name, tensor in first.state_dict().items():
        assert torch.equal(tensor, second.state_dict()[name]), name
    assert not torch.equal(first.obs_std, torch.ones_like(first.obs_std))  # normalisation stats were saved


def test_bc_cache_is_created_once_and_keyed_by_config(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = tiny_config(tmp_path, **{"pretrain.train_steps": 5})
    path = ensure_bc_checkpoint(config)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_bc_checkpoint(config) == path and (path / "model.safetensors").stat().st_mtime_ns == stamp
    other = tiny_config(tmp_path, **{"pretrain.train_steps": 6})
    assert bc_cache_key(other) != bc_cache_key(config)
    for unrelated in ({"algorithm.clip_eps": 0.1}, {"policy.sigma_max": 0.3}, {"policy.init_noise_std": 1.0},
                      {"env.solved_task_weight": 0.25}, {"env.task_weights": {"pick-place-v3": 2.0}}):  # fmt: skip
        assert bc_cache_key(tiny_config(tmp_path, **{"pretrain.train_steps": 5}, **unrelated)) == bc_cache_key(config)
    assert bc_cache_key(tiny_config(tmp_path, **{"pretrain.train_steps": 5, "policy.hidden_dim": 48})) != bc_cache_key(config)


@pytest.mark.parametrize(
    ("success_by_demos", "expected", "tried", "warns"),
    [
        ({5: 0.36}, 5, [5], False),  # pick-place: the calibrated count is already inside the window
        ({5: 0.10, 7: 0.15, 10: 0.50}, 10, [5, 7, 10], False),  # too weak: more demonstrations
        ({5: 0.90, 3: 0.80, 2: 0.60}, 2, [5, 3, 2], False),  # too strong: fewer
        ({5: 0.10, 7: 0.90}, 5, [5, 7], True),  # jumps over the window: the closer of the two, with a warning
        (dict.fromkeys((5, 7, 10, 15, 20, 30, 50), 0.0), 5, [5, 7, 10, 15, 20, 30, 50], True),  # never reaches it
    ],
)
def test_demo_count_search_lands_in_the_window(tmp_path, monkeypatch, success_by_demos, expected, tried, warns) -> None:
    import warnings as warnings_module

    import learner.bc.starting_checkpoint as pretrain_module

    calls = []

    def fake_cached(config):
        calls.append(config.pretrain.num_demos)
        return tmp_path / f"bc{config.pretrain.num_demos}", {"eval_success_rate": success_by_demos[config.pretrain.num_demos]}

    monkeypatch.setattr(pretrain_module, "cached_bc_checkpoint", fake_cached)
    config = tiny_config(tmp_path, **{"pretrain.num_demos": "null", "pretrain.eval_episodes": 100})
    with warnings_module.catch_warnings(record=True) as caught:
        warnings_module.simplefilter("always")
        chosen = pretrain_module.ensure_bc_checkpoint(config)
    assert chosen == tmp_path / f"bc{expected}"
    assert calls == tried
    assert any("no demonstration count" in str(w.message) for w in caught) == warns


def test_a_multi_task_run_raises_each_tasks_count_from_the_fewest_until_it_reaches_the_window(tmp_path, monkeypatch) -> None:
    import warnings as warnings_module

    import learner.bc.starting_checkpoint as pretrain_module

    tasks = ["reach-v3", "push-v3", "pick-place-v3", "door-open-v3"]
    success = {"reach-v3": {1: 0.1, 2: 0.15, 3: 0.3}, "push-v3": {1: 0.9}, "pick-place-v3": {}}  # pick-place: 0 at every count
    resolved = []

    def fake_cached(config):
        resolved.append(config.pretrain)
        counts = demo_counts(config.pretrain, tasks)
        per_task = {task: [success[task].get(count, 0.0) if task in success else 0.5, 0.0, 1.0] for task, count in counts.items()}
        return tmp_path / f"bc{len(resolved)}", {"per_task": per_task}

    monkeypatch.setattr(pretrain_module, "cached_bc_checkpoint", fake_cached)
    sets = {"env.task": ",".join(tasks), "policy.obs_dim": 43, "pretrain.num_demos": "null", "pretrain.eval_episodes": 100,
            "pretrain.task_demos": "{door-open-v3: 7}"}  # fmt: skip
    config = tiny_config(tmp_path, **sets)
    with warnings_module.catch_warnings(record=True) as caught:
        warnings_module.simplefilter("always")
        chosen = pretrain_module.ensure_bc_checkpoint(config)
    assert [(cfg.num_demos, cfg.task_demos) for cfg in resolved[:3]] == [
        (1, {"door-open-v3": 7}),
        (1, {"reach-v3": 2, "pick-place-v3": 2, "door-open-v3": 7}),
        (1, {"reach-v3": 3, "pick-place-v3": 3, "door-open-v3": 7}),
    ]
    # reach stops at 3 (inside), push stays at 1 (above at the fewest), pick-place climbs to the last count
    assert resolved[-1].task_demos == {"reach-v3": 3, "pick-place-v3": 50, "door-open-v3": 7}
    assert len(resolved) == len(pretrain_module.TASK_DEMO_LADDER) and chosen == tmp_path / f"bc{len(resolved)}"
    (warning,) = [str(w.message) for w in caught if "outside" in str(w.message)]
    assert warning.split(" for ", 1)[1].startswith("push-v3 0.90 at 1 demos, pick-place-v3 0.00 at 50 demos. Set")


def test_failed_demonstrations_are_named_and_successful_demos_only_clones_the_first_that_succeed(tmp_path) -> None:
    """push-back's scripted expert, with the demonstrations' noise, fails on layouts 5 and 7 of benchmark seed 0: cloning
    the first eight names both (unless push-back is left out of warn_failed); successful_demos_only takes the first
    eight that succeed, the same episodes where they coincide, and asking for more successes than the layouts hold is
    refused naming the task."""
    import warnings as warnings_module

    from common.demonstrations import FailedDemonstrationWarning, successful_episodes
    from common.suites import make_suite
    from learner.bc.training import expert_demonstrations

    episodes = {"env.task": "push-back-v3", "env.max_episode_steps": 200, "pretrain.num_demos": 8}  # the default episode limit
    config = tiny_config(tmp_path, **episodes)
    suite, policy = make_suite(config.env), build_policy(config.policy)
    failed = r"push-back-v3: 2 of its 8 scripted demonstrations did not succeed \(layouts \[5, 7\]"
    with pytest.warns(FailedDemonstrationWarning, match=failed):
        _, _, all_eight = expert_demonstrations(config, suite, policy, [], {"push-back-v3": 8})
    assert [episode.success for episode in all_eight] == [True] * 5 + [False, True, False]
    with warnings_module.catch_warnings():  # a caller collecting push-back again after naming its failures
        warnings_module.simplefilter("error", FailedDemonstrationWarning)
        _, _, again = expert_demonstrations(config, suite, policy, [], {"push-back-v3": 8}, warn_failed=[])
    assert [episode.success for episode in again] == [episode.success for episode in all_eight]

    kept_config = tiny_config(tmp_path, **episodes, **{"pretrain.successful_demos_only": True})
    with warnings_module.catch_warnings():
        warnings_module.simplefilter("error", FailedDemonstrationWarning)
        _, _, kept = expert_demonstrations(kept_config, suite, policy, [], {"push-back-v3": 8})
    assert all(episode.success for episode in kept) and [episode.layout.index for episode in kept][:6] == [0, 1, 2, 3, 4, 6]
    for episode, same in zip(kept[:6], [all_eight[i] for i in (0, 1, 2, 3, 4, 6)], strict=True):
        np.testing.assert_array_equal(episode.actions, same.actions)
    with pytest.raises(ConfigError, match=r"expert of push-back-v3 succeeded on 6 of the 8 layouts it was given, fewer than the 7"):
        list(successful_episodes(suite, "push-back-v3", suite.layouts("push-back-v3", [0])[:8], 7, 0.1, 0))


def test_successful_demos_only_is_refused_beside_a_dataset_and_is_part_of_the_cache_key(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"pretrain\.successful_demos_only chooses among the scripted expert's episodes.*: set "):
        tiny_config(tmp_path, **{"pretrain.dataset": str(tmp_path), "pretrain.successful_demos_only": True})
    assert bc_cache_key(tiny_config(tmp_path, **{"pretrain.successful_demos_only": True})) != bc_cache_key(tiny_config(tmp_path))


def test_cloning_curve_trains_each_count_for_each_budget_and_marks_each_counts_best(tmp_path, monkeypatch, capsys) -> None:
    """`learner.pretrain --demos 1,2 --train-steps 20,40`: four clones, each scored on the held-out layouts as the
    cache's (the same report), each count's best over its budgets marked, every clone a checkpoint a run can start from."""
    from learner import pretrain as pretrain_command
    from tests.conftest import TINY_RUN, overrides

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    fields = {**TINY_RUN, "pretrain.eval_episodes": 3}
    sets = [arg for item in overrides(fields) for arg in ("--set", item)]
    out = tmp_path / "curve"
    assert pretrain_command.main([*sets, "--demos", "1,2", "--train-steps", "20,40", "--out", str(out)]) == 0
    curve = json.loads((out / "curve.json").read_text())
    assert [(row["demos_per_task"], row["train_steps"]) for row in curve["rows"]] == [(1, 20), (1, 40), (2, 20), (2, 40)]
    for count in (1, 2):
        rows = [row for row in curve["rows"] if row["demos_per_task"] == count]
        assert sum(row["best"] for row in rows) == 1 and max(rows, key=lambda row: row["success"])["best"]
    for row in curve["rows"]:
        report = json.loads((out / row["checkpoint"] / REPORT_FILE).read_text())
        assert (report["demos"], report["config"]["pretrain"]["train_steps"]) == (row["demos_per_task"], row["train_steps"])
        assert report["eval_success_rate"] == row["success"] and report["eval_episodes"] == 3
        FlowPolicy.from_pretrained(out / row["checkpoint"])  # checksums verified, strict
    printed = capsys.readouterr().out
    assert "| 2 | 40 |" in printed and printed.count("**") == 4  # two counts, each one best in bold
