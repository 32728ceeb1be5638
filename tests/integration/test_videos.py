"""Videos of held-out episodes: filming that reproduces evaluation step for step, the actor's films and a run's video
layout, and `python -m learner.replay`."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import av
import numpy as np
import pytest
import torch
import yaml

from actors.rollout_actor import RolloutActor
from common.config import EnvConfig
from common.policy import FlowPolicy
from common.recording import filmed_slots, record_layouts, save_evaluation_videos
from common.rollout import episode_groups, evaluate_layouts
from common.suites.metaworld import FilmedTaskEnv, ImageConfig, MetaworldSuite, MetaworldTaskEnv
from learner import replay
from learner.files.checkpoints import TRAINER_STATE_FILE
from learner.files.run_dir import LATEST_FILE, RUN_CONFIG_FILE
from tests.conftest import tiny_config

layouts = MetaworldSuite(EnvConfig()).layouts


def decode(path: Path) -> np.ndarray:
    with av.open(str(path)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


class Traced:
    """Keeps every episode's states, per layout, so a test can compare two runs of the same layouts step by step."""

    def reset(self, **kwargs):
        obs, info = super().reset(**kwargs)
        self.traces = getattr(self, "traces", {})
        self.traces[self.layout] = [obs]
        return obs, info

    def step(self, action):
        result = super().step(action)
        self.traces[self.layout].append(result[0])
        return result


class TracedEnv(Traced, MetaworldTaskEnv):
    pass


class TracedFilmedEnv(Traced, FilmedTaskEnv):
    pass


def test_filmed_episodes_are_the_evaluated_ones_step_for_step(tmp_path, bc_checkpoint) -> None:
    config = tiny_config(tmp_path, **{"env.max_episode_steps": 24})
    policy = FlowPolicy.from_pretrained(bc_checkpoint)
    held_out = layouts(config.env.task, config.env.eval_benchmark_seeds)[:5]
    env = config.env
    plain = [TracedEnv(env.task, env.max_episode_steps, env.stop_on_success, env.reward, layout=held_out[0]) for _ in range(2)]
    successes = evaluate_layouts(policy, plain, held_out)
    traces = {layout: trace for e in plain for layout, trace in e.traces.items()}
    assert len(plain[0].traces) == episode_groups(held_out, len(plain)) == 3  # each group of two resets the first env once

    def filmed(slots):
        return {k: TracedFilmedEnv(env, env.task, [], ImageConfig(40, 40, "corner4"), held_out[0]) for k in slots}

    films = filmed([0, 1])
    recordings = record_layouts(policy, plain, films, held_out)
    assert [r.layout for r in recordings] == held_out
    assert [r.success for r in recordings] == list(successes)
    filmed_traces = {layout: trace for e in films.values() for layout, trace in e.traces.items()}
    for recording in recordings:
        expected = np.stack(traces[recording.layout])
        np.testing.assert_array_equal(np.stack(filmed_traces[recording.layout]), expected)  # every state, bit for bit
        assert recording.steps == len(expected) - 1 and recording.frames.shape == (recording.steps, 40, 40, 3)
        assert recording.frames.dtype == np.uint8 and recording.frames.std() > 0
    # One position of a group is filmed in its evaluated batch: the same episode, the same frames.
    # Position 3 runs in slot 1 of its group of two: a filmed env for that slot alone films it, none for another.
    assert filmed_slots(2, [3]) == [1]
    with pytest.raises(ValueError, match=r"no filmed env for slot\(s\) \[1\]"):
        record_layouts(policy, plain, filmed([0]), held_out, positions=[3])
    more = filmed([1])
    again = record_layouts(policy, plain, more, held_out, positions=[3])
    assert len(again) == 1 and again[0].layout == held_out[3] and again[0].steps == recordings[3].steps
    np.testing.assert_array_equal(again[0].frames, recordings[3].frames)
    for e in plain + list(films.values()) + list(more.values()):
        e.close()


def test_the_actor_films_what_it_evaluates_and_the_run_layout_of_videos(tmp_path, bc_checkpoint) -> None:
    config = tiny_config(tmp_path, **{"env.max_episode_steps": 16, "actors.envs_per_actor": 2})
    actor = RolloutActor(config, 0, bc_checkpoint)
    held_out = layouts(config.env.task, config.env.eval_benchmark_seeds)[:3]
    _, successes = actor.evaluate(None, held_out)
    recordings = actor.record_episodes(None, held_out, 32, positions=[0, 2])
    actor.close()
    assert [(r.layout, r.success) for r in recordings] == [(held_out[0], successes[0]), (held_out[2], successes[2])]
    paths = save_evaluation_videos(tmp_path / "run", 7, recordings)
    for path, recording in zip(paths, recordings):
        assert path.parent == tmp_path / "run" / "videos" / "iter_000007"
        assert path.name == f"{config.env.task}_1-0{recording.layout.index}_{recording.outcome}_{recording.steps}steps.mp4"
        assert decode(path).shape == (recording.steps, 32, 32, 3)


SUMMARY = re.compile(r"^(?P<task>[\w-]+) layout (?P<layout>\d+-\d\d): (?P<outcomes>.+) -> (?P<path>\S+\.mp4)$")


def run_replay(capsys, *argv: str) -> tuple[int, list[re.Match | None], str]:
    """The exit status, each stdout line matched as a summary line (None where it is none), and stderr."""
    status = replay.main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return status, [SUMMARY.match(line) for line in captured.out.strip().splitlines()], captured.err


def test_replay_films_held_out_episodes_of_a_bc_checkpoint(tmp_path, bc_checkpoint, capsys) -> None:
    status, lines, err = run_replay(capsys, bc_checkpoint, "--episodes", 2, "--size", 32, "--out", tmp_path / "out")
    assert status == 0 and len(lines) == 2 and all(lines)
    assert err.count("[replay] episode") == 2
    max_steps = json.loads((bc_checkpoint / "pretrain.json").read_text())["config"]["env"]["max_episode_steps"]
    for match, index in zip(lines, (0, 1)):
        assert match["layout"] == f"1-0{index}" and match["task"] == "pick-place-v3"
        steps = int(re.search(r"in (\d+) steps", match["outcomes"])[1])
        assert steps <= max_steps  # the BC report's env rules
        assert decode(Path(match["path"])).shape == (steps, 32, 32, 3)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(Path(m["path"]).name for m in lines)


def test_replay_compare_films_two_checkpoints_side_by_side(tmp_path, bc_checkpoint, capsys) -> None:
    other = FlowPolicy.from_pretrained(bc_checkpoint)
    with torch.no_grad():
        other.velocity_net[0].bias.add_(0.5)  # another policy, the same architecture
    other.save_pretrained(tmp_path / "other")
    status, lines, _ = run_replay(capsys, bc_checkpoint, "--compare", tmp_path / "other", "--episodes", 1, "--size", 32,
                                  "--out", tmp_path / "out", "--seed", 3)  # fmt: skip
    assert status == 0 and len(lines) == 1 and lines[0]
    assert re.fullmatch(r"checkpoint: \w+ in (\d+) steps \| other: \w+ in (\d+) steps", lines[0]["outcomes"])
    left, right = (int(n) for n in re.findall(r"in (\d+) steps", lines[0]["outcomes"]))
    assert decode(Path(lines[0]["path"])).shape == (max(left, right), 32, 64, 3)
    expected = layouts("pick-place-v3", [1, 6])[np.random.default_rng(3).choice(100, 1)[0]]
    assert lines[0]["layout"] == f"{expected.benchmark_seed}-{expected.index:02d}"


def test_replay_of_a_run_directory_uses_the_runs_config_and_latest_checkpoint(tmp_path, bc_checkpoint, capsys) -> None:
    run = tmp_path / "run"
    shutil.copytree(bc_checkpoint, run / "checkpoints" / "iter_000002")
    (run / "checkpoints" / "iter_000002" / TRAINER_STATE_FILE).write_bytes(b"unused by replay")
    (run / "checkpoints" / LATEST_FILE).write_text("iter_000002")
    config = tiny_config(tmp_path, **{"env.max_episode_steps": 6})
    (run / RUN_CONFIG_FILE).write_text(json.dumps(config.to_dict()))
    status, lines, _ = run_replay(capsys, run, "--episodes", 1, "--size", 24, "--out", tmp_path / "out")
    assert status == 0 and len(lines) == 1 and lines[0]
    steps = int(re.search(r"in (\d+) steps", lines[0]["outcomes"])[1])
    assert steps <= 6  # the run's env rules, not the 40 steps of the BC report beside the weights
    assert decode(Path(lines[0]["path"])).shape == (steps, 24, 24, 3)


def test_replay_of_a_smolvla_checkpoint_films_through_its_own_cameras(tmp_path, capsys) -> None:
    from tests.helpers.vla import tiny_smolvla

    tiny_smolvla().save_pretrained(tmp_path / "smolvla")
    settings = tmp_path / "short.yaml"
    settings.write_text(yaml.safe_dump({"env": {"max_episode_steps": 8}, "policy": {"num_steps": 3}}))
    status, lines, _ = run_replay(capsys, tmp_path / "smolvla", "--config", settings, "--size", 32, "--episodes", 1,
                                  "--out", tmp_path / "out")  # fmt: skip
    lines = [line for line in lines if line]  # lerobot prints as it builds the model
    assert status == 0 and len(lines) == 1
    steps = int(re.search(r"in (\d+) steps", lines[0]["outcomes"])[1])
    assert steps <= 8 and decode(Path(lines[0]["path"])).shape == (steps, 32, 32, 3)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["{missing}"], "does not exist"),
        (["{checkpoint}", "--task", "fly-v3"], "--task: unknown task 'fly-v3'"),
        (["{checkpoint}", "--episodes", "0"], "--episodes must be in [1, 100]"),
        (["{checkpoint}", "--out", "{file}"], "exists and is not a directory"),
        (["{checkpoint}", "--compare", "{file}"], "is not a directory"),
        (["{empty}"], "has no config.json"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_with_nothing_written(tmp_path, bc_checkpoint, capsys, argv, message) -> None:
    (tmp_path / "a_file").write_text("")
    (tmp_path / "empty").mkdir()
    names = {"missing": tmp_path / "nope", "checkpoint": bc_checkpoint, "file": tmp_path / "a_file", "empty": tmp_path / "empty"}
    before = sorted(tmp_path.rglob("*"))
    status = replay.main([arg.format(**names) for arg in argv] + (["--out", str(tmp_path / "out")] if "--out" not in argv else []))
    err = capsys.readouterr().err
    assert status == 2 and message in err and err.count("\n") == 1
    assert sorted(tmp_path.rglob("*")) == before
