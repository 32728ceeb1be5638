"""The run directory: one run at a time, a config fixed for the run's lifetime, checkpoints with checksums, a checked
`latest` pointer with fallback to the previous complete checkpoint, and a metrics log that survives a torn last line."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import warnings
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from common.config import ConfigError
from common.config_loading import load_config
from common.metrics import MetricsLog
from common.policy import (
    CHECKSUMS_FILE,
    CONFIG_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    CheckpointWriteError,
    FlowPolicy,
    read_policy_config,
    write_directory_atomically,
)
from learner.files.run_dir import LOCK_FILE, RUN_CONFIG_FILE, DiskSpaceWarning, RunDirectory, RunDirLockedError
from learner.update.learner import Learner
from tests.conftest import tiny_config
from tests.helpers.errors import one_line_error


def test_a_second_run_on_a_held_directory_is_refused_and_a_stale_lock_is_taken_over(tmp_path) -> None:
    directory = RunDirectory(tmp_path / "run")
    with directory.locked():
        with pytest.raises(RunDirLockedError, match=f"in use by process {os.getpid()}"):
            with RunDirectory(tmp_path / "run").locked():
                pass
    assert not (tmp_path / "run" / LOCK_FILE).exists()
    # A lock left by a process that is gone (killed before it could clean up) does not block the next run.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True)
    (tmp_path / "run" / LOCK_FILE).write_text(json.dumps({"pid": int(dead.stdout), "host": os.uname().nodename, "started": "x"}))
    with directory.locked():
        assert json.loads((tmp_path / "run" / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_empty_run_dir_is_refused() -> None:
    with pytest.raises(ConfigError, match="run_dir must not be empty"):
        RunDirectory("  ")


def test_resume_refuses_a_changed_config_and_names_the_fields(tmp_path, mlp_checkpoint) -> None:
    config = tiny_config(tmp_path)
    directory = RunDirectory(config.run_dir)
    with directory.locked():
        directory.start_new(config)
        Learner(config, FlowPolicy.from_pretrained(mlp_checkpoint)).save_checkpoint(directory.checkpoints / "iter_000001")
        directory.write_latest("iter_000001")
        with pytest.raises(FileExistsError, match="already holds a run"):
            directory.start_new(config)
    changed = tiny_config(tmp_path, seed=3, **{"algorithm.clip_eps": 0.1, "eval_every": 7})
    assert directory.config_changes(changed) == {"seed": (0, 3), "algorithm.clip_eps": (0.05, 0.1), "eval_every": (0, 7)}
    with pytest.raises(ConfigError, match=r"algorithm\.clip_eps: 0\.05 -> 0\.1; seed: 0 -> 3\. Resume"):
        directory.resume(changed)  # eval_every is safe to change and is not listed
    assert directory.resume(changed, {"seed", "algorithm.clip_eps"}).name == "iter_000001"
    assert directory.resume(tiny_config(tmp_path, iterations=5)).name == "iter_000001"  # extending the run is fine
    with pytest.raises(ConfigError, match="iterations=1 but .* has completed 1"):
        directory.resume(tiny_config(tmp_path, iterations=1))


def test_a_field_the_schema_lacks_is_refused_in_one_line_from_a_file_a_checkpoint_or_a_recorded_run(tmp_path, mlp_checkpoint) -> None:
    """A field the schema does not have (policy.dropout: a policy has no dropout, which would make the rescored log-probs
    random) is named in one line wherever it comes from, with the known fields; a field the schema gained since a run
    was recorded differs from nothing at its default, and is a change at another value."""
    config = tiny_config(tmp_path)

    def with_dropout_field(path: Path, value: float) -> None:
        data = json.loads(path.read_text())
        (data["policy"] if "policy" in data else data)["dropout"] = value
        path.write_text(json.dumps(data))

    def checkpoint_with_dropout() -> Path:
        def write(tmp: Path) -> None:
            FlowPolicy.from_pretrained(mlp_checkpoint).save_pretrained(tmp)
            with_dropout_field(tmp / CONFIG_FILE, 0.0)

        return write_directory_atomically(tmp_path / "with_dropout", write)

    one_line_error(CheckpointError, lambda: read_policy_config(checkpoint_with_dropout()), "unknown field(s) ['policy.dropout']")
    yaml_file = tmp_path / "with_dropout.yaml"
    yaml_file.write_text("policy:\n  dropout: 0.0\n")
    one_line_error(ConfigError, lambda: load_config(yaml_file), "unknown field(s) ['policy.dropout']")
    one_line_error(ConfigError, lambda: load_config(None, ["policy.dropout=0.5"]), "unknown field(s) ['policy.dropout']")
    directory = RunDirectory(config.run_dir)
    with directory.locked():
        directory.start_new(config)
        Learner(config, FlowPolicy.from_pretrained(mlp_checkpoint)).save_checkpoint(directory.checkpoints / "iter_000001")
        directory.write_latest("iter_000001")
    recorded = json.loads((directory.path / RUN_CONFIG_FILE).read_text())
    del recorded["policy"]["smolvla"]["vlm_hub_id"]
    (directory.path / RUN_CONFIG_FILE).write_text(json.dumps(recorded))
    assert directory.config_changes(config) == {}
    named = tiny_config(tmp_path, **{"policy.smolvla.vlm_hub_id": "owner/backbone"})
    assert directory.config_changes(named) == {"policy.smolvla.vlm_hub_id": (None, "owner/backbone")}


@pytest.fixture()
def run_with_checkpoints(tmp_path, mlp_checkpoint):
    config = tiny_config(tmp_path)
    learner = Learner(config, FlowPolicy.from_pretrained(mlp_checkpoint))
    directory = RunDirectory(config.run_dir)
    for name in ("iter_000001", "iter_000002"):
        learner.save_checkpoint(directory.checkpoints / name)
        directory.write_latest(name)
    return directory


def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(run_with_checkpoints) -> None:
    directory = run_with_checkpoints
    assert directory.latest_checkpoint().name == "iter_000002"
    weights = directory.checkpoints / "iter_000002" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated, as by a full disk
    assert directory.latest_checkpoint().name == "iter_000001"
    (directory.checkpoints / "iter_000001" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="no earlier complete checkpoint"):
        directory.latest_checkpoint()


def test_the_latest_pointer_must_name_a_checkpoint_of_this_run(run_with_checkpoints) -> None:
    directory = run_with_checkpoints
    directory.write_latest("../../elsewhere")
    with pytest.raises(CheckpointError, match="not a checkpoint of this run"):
        directory.latest_checkpoint()


def test_leftover_temp_directories_are_removed_when_a_run_takes_the_directory(run_with_checkpoints) -> None:
    directory = run_with_checkpoints
    leftovers = [directory.checkpoints / ".iter_000003.tmp-1234", directory.checkpoints / ".iter_000002.old-1234"]
    for leftover in leftovers:
        leftover.mkdir()
    with directory.locked():
        assert not any(p.exists() for p in leftovers)
        assert directory.latest_checkpoint().name == "iter_000002"


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(args[1]) if len(args) > 1 else None)


def test_a_checkpoint_write_on_a_full_disk_leaves_no_trace_and_the_previous_one_loadable(run_with_checkpoints, tmp_path, mlp_checkpoint,
                                                                                          monkeypatch) -> None:  # fmt: skip
    directory = run_with_checkpoints
    before = {p.name: p.read_bytes() for p in (directory.checkpoints / "iter_000002").iterdir()}
    learner = Learner(tiny_config(tmp_path), FlowPolicy.from_pretrained(mlp_checkpoint))
    monkeypatch.setattr(torch, "save", no_space)  # the trainer state, written after the weights: a half-written directory
    for name in ("iter_000003", "iter_000002"):  # a new checkpoint, and one replacing an existing one
        with pytest.raises(CheckpointWriteError, match=f"could not write .*{name}: No space left on device \\(trainer_state.pt\\)"):
            learner.save_checkpoint(directory.checkpoints / name)
    assert sorted(p.name for p in directory.checkpoints.iterdir()) == ["iter_000001", "iter_000002", "latest"]  # no partial copy
    assert {p.name: p.read_bytes() for p in (directory.checkpoints / "iter_000002").iterdir()} == before
    assert directory.latest_checkpoint().name == "iter_000002"
    assert directory.checkpoint_problem(directory.checkpoints / "iter_000002") is None

    monkeypatch.setattr(os, "replace", no_space)  # the pointer itself cannot be replaced
    with pytest.raises(CheckpointWriteError, match=r"could not write .*checkpoints/latest: No space left on device"):
        directory.write_latest("iter_000003")
    assert sorted(p.name for p in directory.checkpoints.iterdir()) == ["iter_000001", "iter_000002", "latest"]
    assert directory.latest_checkpoint().name == "iter_000002"


def test_metrics_log_survives_a_torn_last_line(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 1, "x": 1}\n{"iteration": 2, "x": 2}\n{"iteration": 3, "x"')
    assert [r["iteration"] for r in MetricsLog(path).read()] == [1, 2]
    log = MetricsLog(path)  # a resumed run's log: the torn fragment is cut before the next row
    log.write({"iteration": 3, "x": 3.0})
    assert [r["x"] for r in log.read()] == [1, 2, 3.0]
    path.write_text('{"iteration": 1}\ngarbage\n{"iteration": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not a JSON line"):
        MetricsLog(path).read()


def test_a_full_disk_under_the_runs_record_loses_no_row_and_no_summary_and_ends_the_run_in_one_line(tmp_path, monkeypatch,
                                                                                                     capsys) -> None:  # fmt: skip
    """metrics.jsonl and summary.json on a full disk: the row refused stays held (the run's stop writes it when it can,
    a resume redoes it), the half-written line is cut at once, the previous summary stays whole,
    and the run ends with one line, exit 1."""
    import types
    from pathlib import Path as PathType

    from common.storage import RunFileWriteError
    from learner import main as main_module
    from learner.runtime.reporting import MetricsRows, RunSummary

    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path)
    log.write({"iteration": 1, "x": 1.0})
    real_open = PathType.open

    def full_after_half(self, mode="r", *args, **kwargs):
        handle = real_open(self, mode, *args, **kwargs)
        if self == path and mode == "a":

            def write(text):
                real_write(text[: len(text) // 2])
                handle.flush()
                no_space(None, self)

            real_write, handle.write = handle.write, write
        return handle

    monkeypatch.setattr(PathType, "open", full_after_half)
    nobody = types.SimpleNamespace(films=None)
    rows = MetricsRows(log, nobody, types.SimpleNamespace(export_gauges=lambda row: None), None, single_batch=False)
    with pytest.raises(RunFileWriteError, match=r"could not write .*metrics\.jsonl: No space left on device \(metrics\.jsonl\)$"):
        rows.add({"iteration": 2, "x": 2.0}, None, wait=False)
    assert [row for row, _ in rows.held] == [{"iteration": 2, "x": 2.0}]  # still held
    monkeypatch.setattr(PathType, "open", real_open)  # room again
    rows.keep_completed()
    assert [row["x"] for row in MetricsLog(path).read()] == [1.0, 2.0] and path.read_text().endswith("}\n")

    summary = RunSummary(types.SimpleNamespace(path=tmp_path), resume=False)
    summary.data = {"iterations": 1}
    summary.write()
    summary.data = {"iterations": 2}
    monkeypatch.setattr(os, "replace", no_space)
    with pytest.raises(RunFileWriteError, match=r"could not write .*summary\.json: No space left on device"):
        summary.write()
    assert json.loads((tmp_path / "summary.json").read_text()) == {"iterations": 1} and not list(tmp_path.glob(".summary*"))

    monkeypatch.setattr(main_module, "run", lambda *args, **kwargs: (_ for _ in ()).throw(RunFileWriteError("could not write m")))
    assert main_module.main(["--run-dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert err == "error: could not write m; the latest checkpoint is kept: continue with --resume\n", err


def test_after_a_learner_restart_held_rows_are_dropped_evaluated_again_or_written_without_their_lost_evaluation(tmp_path) -> None:
    """Rows held for their evaluations when the learner died, a new one started from the checkpoint of iteration 3:
    iteration 2's evaluation finished before the death, iteration 3's was lost (evaluated again with the new learner's
    weights), iteration 4's row is dropped (redone); with the checkpoint at 4, iteration 3's lost evaluation cannot be
    redone (its weights are gone) and its row is written without it, with a warning."""
    import types

    from learner.runtime.failures import LearnerDiedError
    from learner.runtime.reporting import MetricsRows

    class Evaluations:
        films = None

        def __init__(self) -> None:
            self.ran: list[tuple[str, str, int]] = []

        def collect(self, evaluation: types.SimpleNamespace) -> dict[str, float]:
            if evaluation.lost:
                raise LearnerDiedError("the learner that published the weights of rollout actor 0's evaluate call died")
            return {"eval/success_rate": 0.5}

        def run(self, weights_ref: str, label: str, iteration: int) -> dict[str, float]:
            self.ran.append((weights_ref, label, iteration))
            return {"eval/success_rate": 0.75}

    def held_rows(log: MetricsLog) -> MetricsRows:
        rows = MetricsRows(log, Evaluations(), types.SimpleNamespace(export_gauges=lambda row: None), None, single_batch=False)
        rows.held.extend([({"iteration": 2}, types.SimpleNamespace(label="iteration 2", lost=False)),
                          ({"iteration": 3}, types.SimpleNamespace(label="iteration 3", lost=True)), ({"iteration": 4}, None)])  # fmt: skip
        return rows

    rows = held_rows(MetricsLog(tmp_path / "a.jsonl"))
    rows.after_learner_restart(3, "new weights")
    assert not rows.held and rows.evaluator.ran == [("new weights", "iteration 3, again", 3)]
    written = MetricsLog(tmp_path / "a.jsonl").read()
    assert written == [{"iteration": 2, "eval/success_rate": 0.5}, {"iteration": 3, "eval/success_rate": 0.75}]

    rows = held_rows(MetricsLog(tmp_path / "b.jsonl"))
    with pytest.warns(RuntimeWarning, match="the evaluation of iteration 3 was lost with the learner that published its weights"):
        rows.after_learner_restart(4, "new weights")
    assert MetricsLog(tmp_path / "b.jsonl").read() == [{"iteration": 2, "eval/success_rate": 0.5}, {"iteration": 3}, {"iteration": 4}]


def test_keep_checkpoints_deletes_the_oldest_but_never_the_one_latest_names(tmp_path) -> None:
    directory = RunDirectory(tmp_path / "run")
    for iteration in (1, 2, 3, 4):
        (directory.checkpoints / f"iter_{iteration:06d}").mkdir(parents=True)
        (directory.checkpoints / f"iter_{iteration:06d}" / "model.safetensors").write_bytes(b"w")
    (directory.checkpoints / "random_init").mkdir()  # the actors' start in a random-init run: not a checkpoint of the run's
    directory.write_latest("iter_000004")
    assert directory.prune_checkpoints(2) == ["iter_000001", "iter_000002"]
    assert sorted(p.name for p in directory.checkpoints.iterdir()) == ["iter_000003", "iter_000004", "latest", "random_init"]
    directory.write_latest("iter_000003")  # as after a fallback from a corrupt newest checkpoint
    assert directory.prune_checkpoints(1) == []
    assert directory.prune_checkpoints(0) == ["iter_000004"]


def test_a_prune_cut_short_leaves_a_leftover_that_the_next_start_removes(tmp_path) -> None:
    directory = RunDirectory(tmp_path / "run")
    leftover = directory.checkpoints / ".iter_000001.old-12345"  # renamed for deletion, then the process died
    leftover.mkdir(parents=True)
    with directory.locked():
        assert not leftover.exists()


DiskUsage = namedtuple("DiskUsage", "total used free")


@pytest.mark.parametrize(
    ("sets", "free", "message"),
    [
        # 150 iterations, a checkpoint every 25: 6 of them, every one kept
        ({}, 5.5, r"writes 6 checkpoints of about 1(\.\d+)? MB? .* keeps every one \(keep_checkpoints=0\): up to 6"),
        ({"keep_checkpoints": 2}, 2.5, r"writes 6 checkpoints .* keeps the newest 2 \(keep_checkpoints=2\): up to 3"),
        ({"keep_checkpoints": 2}, 3.5, None),  # two kept and the one being written fit
        ({"iterations": 160}, 6.5, r"writes 7 checkpoints"),  # the final one too
    ],
)
def test_checkpoints_that_outgrow_the_disk_are_announced_before_the_run(tmp_path, monkeypatch, sets, free, message) -> None:
    reference = tmp_path / "init"
    reference.mkdir()
    (reference / "model.safetensors").write_bytes(b"x" * 1_000_000)
    config = tiny_config(
        tmp_path, checkpoint_every=25, iterations=sets.get("iterations", 150), **{k: v for k, v in sets.items() if k != "iterations"}
    )
    monkeypatch.setattr("learner.files.run_dir.shutil.disk_usage", lambda path: DiskUsage(10**12, 0, int(free * 1_000_000)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        RunDirectory(config.run_dir).warn_if_checkpoints_outgrow_the_disk(config, reference, completed=0)
    if message is None:
        assert not caught
    else:
        (warning,) = caught
        assert warning.category is DiskSpaceWarning and re.search(message, str(warning.message)), str(warning.message)
        assert "Set keep_checkpoints" in str(warning.message)


def test_a_resumed_run_counts_only_the_checkpoints_still_to_write(tmp_path, monkeypatch) -> None:
    reference = tmp_path / "iter_000100"
    reference.mkdir()
    (reference / "model.safetensors").write_bytes(b"x" * 1_000_000)
    config = tiny_config(tmp_path, checkpoint_every=25, iterations=150)
    monkeypatch.setattr("learner.files.run_dir.shutil.disk_usage", lambda path: DiskUsage(10**12, 0, 1))
    with pytest.warns(DiskSpaceWarning, match="writes 2 checkpoints"):
        RunDirectory(config.run_dir).warn_if_checkpoints_outgrow_the_disk(config, reference, completed=100)


def test_checkpoints_carry_checksums_and_a_corrupt_one_is_refused_by_name(tmp_path, mlp_checkpoint) -> None:
    run = RunDirectory(tmp_path / "run")
    policy = FlowPolicy.from_pretrained(mlp_checkpoint)
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
