"""Every command's bad input, by class (missing, empty, wrong kind, corrupt, mismatched features, existing output):
refused in one line naming the field or file, exit status 2, no traceback, nothing written or created, and never a
request to the model hub. docs/faults.md has the table; learner.main's own cases are tests/integration/test_bad_input.py.

Each case is (command, argv builder, message). The builder makes its inputs under `inputs` (from the tests' tiny
checkpoint and dataset) and returns the argv; what the command then writes is compared with what was there before.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pandas
import pytest

import learner.main as main_module
from common.policy import WEIGHTS_FILE
from learner import dataset, diagnose, export, lerobot_tools, parity, pretrain, replay, sweep
from learner.main import main as learner_main
from tests.conftest import tiny_run

COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "pretrain": pretrain.main, "dataset": dataset.main, "export": export.main, "replay": replay.main, "diagnose": diagnose.main,
    "sweep": sweep.main, "lerobot_tools": lerobot_tools.main, "parity": parity.main, "main": learner_main,
}  # fmt: skip
TINY = ["--set", "policy.hidden_dim=64", "--set", "policy.num_layers=2", "--set", "env.max_episode_steps=40"]


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory) -> Path:
    """Two scripted pick-place episodes as learner.dataset writes them for the tiny MLP (state and action only)."""
    out = tmp_path_factory.mktemp("dataset") / "pick-place"
    assert dataset.main(["--out", str(out), "--episodes", "2", *TINY]) == 0
    return out


def dataset_copy(inputs: Path, source: Path, damage: Callable[[Path], None]) -> str:
    copy = inputs / "dataset"
    shutil.copytree(source, copy)
    damage(copy)
    return str(copy)


def edit_info(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(directory: Path) -> None:
        info = json.loads((directory / "meta" / "info.json").read_text())
        change(info)
        (directory / "meta" / "info.json").write_text(json.dumps(info))

    return damage


def other_task(directory: Path) -> None:
    tasks = directory / "meta" / "tasks.parquet"
    pandas.DataFrame({"task_index": [0]}, index=["reach the goal"]).to_parquet(tasks)


def corrupt_checkpoint(inputs: Path, checkpoint: Path) -> str:
    copy = inputs / "checkpoint"
    shutil.copytree(checkpoint, copy)
    data = bytearray((copy / WEIGHTS_FILE).read_bytes())
    data[-1] ^= 0xFF
    (copy / WEIGHTS_FILE).write_bytes(bytes(data))
    return str(copy)


def empty_directory(inputs: Path, name: str = "empty") -> str:
    (inputs / name).mkdir()
    return str(inputs / name)


def a_file(inputs: Path, name: str = "file") -> str:
    (inputs / name).write_text("not a directory")
    return str(inputs / name)


def broken_info(directory: Path) -> None:
    (directory / "meta" / "info.json").write_text("{")


narrow_state = edit_info(lambda info: info["features"]["observation.state"].update(shape=[4]))
CORRUPT_WEIGHTS = r"model\.safetensors does not match its sha256"


def with_dataset(value: str, *argv: str) -> list[str]:
    return ["--set", f"pretrain.dataset={value}", *TINY, *argv]


# (command, case, builder(inputs, checkpoint, dataset, out) -> argv, message regex)
CASES = [
    # learner.pretrain: its dataset, by class, and its output
    ("pretrain", "missing dataset", lambda i, c, d, o: with_dataset(str(i / "nowhere"), "--out", o),
     r"pretrain\.dataset .*nowhere does not exist"),
    ("pretrain", "empty dataset", lambda i, c, d, o: with_dataset(empty_directory(i), "--out", o), r"pretrain\.dataset .*empty is empty"),
    ("pretrain", "dataset a file", lambda i, c, d, o: with_dataset(a_file(i), "--out", o), r"pretrain\.dataset .*file is a file"),
    ("pretrain", "not a dataset", lambda i, c, d, o: with_dataset(str(Path(a_file(i, "notes.txt")).parent), "--out", o),
     r"pretrain\.dataset .* has no meta/info\.json"),
    ("pretrain", "corrupt info.json", lambda i, c, d, o: with_dataset(dataset_copy(i, d, broken_info), "--out", o),
     r"its meta/ files are corrupt .*JSONDecodeError"),
    ("pretrain", "state width", lambda i, c, d, o: with_dataset(dataset_copy(i, d, narrow_state), "--out", o),
     r"observation\.state is \(4,\), the policy reads \(39,\)"),
    ("pretrain", "another task", lambda i, c, d, o: with_dataset(dataset_copy(i, d, other_task), "--out", o),
     r"holds the tasks \['reach the goal'\], which are not the run's"),
    ("pretrain", "no episodes", lambda i, c, d, o: with_dataset(dataset_copy(i, d, lambda p: shutil.rmtree(p / "data")), "--out", o),
     r"holds no episodes .*file-000\.parquet is missing"),
    ("pretrain", "existing output", lambda i, c, d, o: ["--out", empty_directory(i, "taken")], r"--out .*taken' already exists"),
    ("pretrain", "bad counts", lambda i, c, d, o: ["--demos", "0,5", "--out", o], r"--demos must be distinct counts in \[1, 50\]"),
    ("pretrain", "budgets alone", lambda i, c, d, o: ["--train-steps", "3000", "--out", o], r"--train-steps gives the budgets of --demos"),
    ("pretrain", "bad budgets", lambda i, c, d, o: ["--demos", "5", "--train-steps", "0", "--out", o],
     r"--train-steps must be distinct counts >= 1"),
    ("pretrain", "counts and a dataset", lambda i, c, d, o: with_dataset(str(d), "--demos", "2", "--out", o), r"--demos .* drop one"),
    ("pretrain", "unknown field", lambda i, c, d, o: ["--set", "pretrain.num_demo=3", "--out", o],
     r"unknown field\(s\) \['pretrain\.num_demo'\]"),
    # learner.main: what it checks of a dataset before Ray starts (the rest: tests/integration/test_bad_input.py)
    ("main", "corrupt info.json", lambda i, c, d, o: ["--run-dir", o, *with_dataset(dataset_copy(i, d, broken_info))],
     r"its meta/ files are corrupt"),
    ("main", "state width", lambda i, c, d, o: ["--run-dir", o, *with_dataset(dataset_copy(i, d, narrow_state))],
     r"observation\.state is \(4,\)"),
    ("main", "another task", lambda i, c, d, o: ["--run-dir", o, *with_dataset(dataset_copy(i, d, other_task))], r"holds the tasks"),
    ("main", "missing dataset", lambda i, c, d, o: ["--run-dir", o, *with_dataset(str(i / "nowhere"))], r"nowhere does not exist"),
    # learner.dataset
    ("dataset", "existing output", lambda i, c, d, o: ["--out", empty_directory(i, "taken")], r"taken exists: choose another directory"),
    ("dataset", "output a file", lambda i, c, d, o: ["--out", a_file(i), "--overwrite"], r"file exists and is not a directory"),
    ("dataset", "empty output", lambda i, c, d, o: ["--out", " "], r"--out is empty"),
    ("dataset", "episodes", lambda i, c, d, o: ["--out", o, "--episodes", "0"], r"--episodes must be in \[1, 50\]"),
    ("dataset", "missing config", lambda i, c, d, o: ["--out", o, "--config", str(i / "run.yaml")],
     r"config file .*run\.yaml does not exist"),
    # learner.export
    ("export", "missing checkpoint", lambda i, c, d, o: [str(i / "nowhere"), "--out", o], r"checkpoint .*nowhere does not exist"),
    ("export", "empty checkpoint", lambda i, c, d, o: [empty_directory(i), "--out", o], r"empty has no config\.json"),
    ("export", "not a VLA", lambda i, c, d, o: [str(c), "--out", o], r"'mlp_flow' policy, which has no lerobot counterpart"),
    ("export", "corrupt checkpoint", lambda i, c, d, o: [corrupt_checkpoint(i, c), "--out", o], CORRUPT_WEIGHTS),
    ("export", "existing output", lambda i, c, d, o: [str(c), "--out", empty_directory(i, "taken")], r"taken exists: pass --overwrite"),
    ("export", "bad hub id", lambda i, c, d, o: [str(c), "--out", o, "--hub-id", "no slash"], r"--hub-id"),
    # learner.replay
    ("replay", "missing checkpoint", lambda i, c, d, o: [str(i / "nowhere"), "--out", o], r"checkpoint .*nowhere does not exist"),
    ("replay", "empty checkpoint", lambda i, c, d, o: [empty_directory(i), "--out", o], r"empty has no config\.json"),
    ("replay", "corrupt checkpoint", lambda i, c, d, o: [corrupt_checkpoint(i, c), "--out", o], CORRUPT_WEIGHTS),
    ("replay", "output a file", lambda i, c, d, o: [str(c), "--out", a_file(i)], r"--out .*file exists and is not a directory"),
    ("replay", "episodes", lambda i, c, d, o: [str(c), "--out", o, "--episodes", "0"], r"--episodes must be in \[1, 100\]"),
    ("replay", "unknown task", lambda i, c, d, o: [str(c), "--out", o, "--task", "pick-place-v9"], r"--task: unknown task 'pick-place-v9'"),
    # learner.diagnose
    ("diagnose", "missing run", lambda i, c, d, o: [str(i / "nowhere")], r"nowhere is not a run directory: it has no run_config\.json"),
    ("diagnose", "corrupt run config", lambda i, c, d, o: [_run_dir(i, "{")],
     r"run_config\.json is not valid JSON .*the run's record is corrupt"),
    ("diagnose", "no start named", lambda i, c, d, o: [_run_dir(i, "{}")],
     r"has no summary\.json to name its starting checkpoint: pass --start"),
    ("diagnose", "repeats", lambda i, c, d, o: [_run_dir(i, "{}"), "--repeats", "0"], r"--repeats must be >= 1"),
    # learner.sweep: its flags, its directory, and the run's own input checks once before any seed starts
    ("sweep", "seeds", lambda i, c, d, o: ["--seeds", "1", "1", "--sweep-dir", o], r"--seeds must be distinct non-negative integers"),
    ("sweep", "existing output", lambda i, c, d, o: ["--seeds", "0", "--sweep-dir", _taken_sweep(i)], r"already holds runs of seeds \[0\]"),
    ("sweep", "missing checkpoint", lambda i, c, d, o: ["--seeds", "0", "--sweep-dir", o, "--set", f"init_checkpoint={i / 'nowhere'}"],
     r"init checkpoint .*nowhere has no model\.safetensors"),
    # learner.parity: a lerobot checkpoint, scored on one Metaworld task in lerobot's layout
    ("parity", "missing checkpoint", lambda i, c, d, o: [str(i / "nowhere"), "--out", o], r"nowhere is not a lerobot checkpoint"),
    ("parity", "not a lerobot checkpoint", lambda i, c, d, o: [str(c), "--out", o], r"is not a lerobot checkpoint .*learner\.export first"),
    ("parity", "existing output", lambda i, c, d, o: [_lerobot_checkpoint(i), "--out", empty_directory(i, "taken")],
     r"--out .*taken' already exists"),
    ("parity", "episodes", lambda i, c, d, o: [_lerobot_checkpoint(i), "--out", o, "--episodes", "0"],
     r"--episodes and --batch-size must be >= 1"),
    # learner.lerobot_tools: nothing asked of the hub
    ("lerobot_tools", "unknown command", lambda i, c, d, o: ["serve"], r"usage: python -m learner\.lerobot_tools \{train,eval\}"),
    ("lerobot_tools", "missing dataset", lambda i, c, d, o: ["train", f"--dataset.root={i / 'nowhere'}", f"--output_dir={o}"],
     r"--dataset\.root=.*nowhere is not a LeRobotDataset directory .* on this machine"),
    ("lerobot_tools", "missing policy", lambda i, c, d, o: ["eval", f"--policy.path={i / 'nowhere'}", f"--output_dir={o}"],
     r"--policy\.path=.*nowhere is not a checkpoint directory on this machine"),
]  # fmt: skip


def _run_dir(inputs: Path, run_config: str) -> str:
    run = inputs / "run"
    run.mkdir()
    (run / "run_config.json").write_text(run_config)
    return str(run)


def _lerobot_checkpoint(inputs: Path) -> str:
    """A directory whose config.json reads as a lerobot policy's (the checks before any work read no more of it)."""
    (inputs / "lerobot").mkdir()
    (inputs / "lerobot" / "config.json").write_text(json.dumps({"type": "smolvla", "input_features": {}}))
    return str(inputs / "lerobot")


def _taken_sweep(inputs: Path) -> str:
    (inputs / "sweep" / "seed_0").mkdir(parents=True)
    (inputs / "sweep" / "seed_0" / "metrics.jsonl").write_text("")
    return str(inputs / "sweep")


def files_under(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_mtime_ns for p in path.rglob("*")}


@pytest.mark.parametrize(("command", "case", "build", "message"), CASES, ids=[f"{command}-{case}" for command, case, *_ in CASES])
def test_bad_input_is_refused_in_one_line_and_nothing_is_written(tmp_path, monkeypatch, capsys, bc_checkpoint, tiny_dataset, command, case,
                                                                   build, message) -> None:  # fmt: skip
    monkeypatch.setattr(main_module, "connect_ray", lambda address, include_dashboard: False)  # learner.main refuses before Ray
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # a command that built a checkpoint would write here
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    argv = build(inputs, bc_checkpoint, tiny_dataset, str(tmp_path / "out"))
    if command == "main":
        argv = tiny_run(Path(argv[1]), None, *argv[2:])
    before = files_under(tmp_path)
    assert COMMANDS[command](argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(message, err), err
    assert files_under(tmp_path) == before, "a refused command wrote or changed files"


def test_the_table_has_every_command_and_each_class_of_bad_input() -> None:
    """Every command of the project has cases here, and the dataset and checkpoint readers one of each class."""
    assert {command for command, *_ in CASES} == set(COMMANDS)
    cases = {(command, case) for command, case, *_ in CASES}
    for reader in ("pretrain", "main"):
        assert {(reader, case) for case in ("missing dataset", "corrupt info.json", "state width", "another task")} <= cases
    for reader in ("export", "replay"):
        assert {(reader, case) for case in ("missing checkpoint", "empty checkpoint", "corrupt checkpoint")} <= cases
    assert {command for command, case, *_ in CASES if case == "existing output"} == {"pretrain", "dataset", "export", "sweep", "parity"}


def test_a_dataset_lerobot_finds_incomplete_is_refused_without_asking_the_hub(tmp_path, tiny_dataset, monkeypatch) -> None:
    """A dataset whose meta/ files pass the checks but whose data lerobot finds short of its episodes: lerobot would fetch
    the rest from the hub; the request is refused in the process and the read is a ConfigError naming the dataset."""
    from common.config import ConfigError
    from common.lerobot_dataset import read_demonstrations
    from common.suites import make_suite
    from tests.conftest import tiny_config

    broken = Path(dataset_copy(tmp_path, tiny_dataset, edit_info(lambda info: info.update(total_episodes=3))))
    config = tiny_config(tmp_path, **{"policy.hidden_dim": 64})
    before = files_under(broken)
    with pytest.raises(ConfigError, match=r"pretrain\.dataset .*: lerobot found the dataset incomplete and asked the model hub"):
        read_demonstrations(broken, config.policy, make_suite(config.env))
    assert files_under(broken) == before
