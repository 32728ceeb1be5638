"""The processes a run starts take the driver's file digests of its initial checkpoint instead of hashing it again
(tests/unit/test_file_digests.py: digests kept per file version)."""

from __future__ import annotations

import shutil

from actors.rollout_actor import RolloutActor
from common import file_digests
from common.file_digests import file_sha256, known_digests
from common.policy import WEIGHTS_FILE
from learner.runtime.learner_actor import LearnerActor
from learner.runtime.startup import resolve_init_checkpoint
from tests.conftest import tiny_config


def test_the_driver_verifies_the_initial_checkpoint_once_and_the_learner_and_actors_take_its_digests(
    tmp_path, bc_checkpoint, monkeypatch, hashed_files
) -> None:
    """The driver's side (resolve_init_checkpoint: the cached BC checkpoint verified before anything starts), then a
    learner and an actor built in a process that knows only what the driver handed over."""
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(bc_checkpoint, checkpoint)
    weights = checkpoint / WEIGHTS_FILE
    config = tiny_config(tmp_path)
    monkeypatch.setattr("learner.runtime.startup.ensure_bc_checkpoint", lambda config: checkpoint)
    assert resolve_init_checkpoint(config) == checkpoint
    file_sha256(weights)  # the banner's and the manifest's
    assert hashed_files.count(weights) == 1
    handed = known_digests()

    monkeypatch.setattr(file_digests, "_digests", {})  # the learner's process
    LearnerActor(config, str(checkpoint), None, known_digests=handed)
    monkeypatch.setattr(file_digests, "_digests", {})  # an actor's
    RolloutActor(config, 0, checkpoint, known_digests=handed)
    assert hashed_files.count(weights) == 1

    monkeypatch.setattr(file_digests, "_digests", {})
    RolloutActor(config, 1, checkpoint)  # nothing handed over: it verifies for itself
    assert hashed_files.count(weights) == 2

    elsewhere = tmp_path / "elsewhere"  # another machine's copy: the same bytes in other files
    shutil.copytree(checkpoint, elsewhere)
    monkeypatch.setattr(file_digests, "_digests", {})
    RolloutActor(config, 2, elsewhere, known_digests=handed)
    assert hashed_files.count(elsewhere / WEIGHTS_FILE) == 1
