"""Checkpoints: safetensors round trip, clear errors, and the refusal to fine-tune random weights."""

from __future__ import annotations

import json

import pytest
import torch

from common.config import PolicyConfig
from common.diagnostics import RandomInitError
from common.observation import Observation
from common.policy import CheckpointError, FlowPolicy, MLPFlowPolicy
from common.policy.initialisation import initialisation_skipped
from learner.update.learner import require_pretrained


def small_policy(**overrides) -> MLPFlowPolicy:
    torch.manual_seed(0)
    return MLPFlowPolicy(PolicyConfig(hidden_dim=32, num_layers=2, **overrides))


def test_round_trip_is_bit_exact(tmp_path) -> None:
    policy = small_policy()
    policy.set_normalization(torch.randn(39), torch.rand(39) + 0.5, torch.randn(4), torch.rand(4) + 0.5)
    policy.save_pretrained(tmp_path / "ckpt")
    loaded = FlowPolicy.from_pretrained(tmp_path / "ckpt")
    assert isinstance(loaded, MLPFlowPolicy) and not loaded.training
    assert loaded.loaded_from == str((tmp_path / "ckpt").resolve())
    for (name, a), (_, b) in zip(policy.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_model_built_for_loading_draws_no_random_weights() -> None:
    """initialisation_skipped leaves the weights unfilled (no random numbers drawn) and restores torch.nn.init on exit:
    the next model built draws the weights it always drew."""
    config = PolicyConfig(hidden_dim=32, num_layers=2)
    rng = torch.get_rng_state()
    with initialisation_skipped():
        MLPFlowPolicy(config)
        linear = torch.nn.Linear(3, 2)
        assert torch.nn.init.normal_(linear.weight) is linear.weight
    assert torch.equal(torch.get_rng_state(), rng)
    torch.manual_seed(0)
    reference = MLPFlowPolicy(config)
    assert reference.state_dict()["velocity_net.0.weight"].abs().min() > 0
    for (name, a), (_, b) in zip(small_policy().state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name


def test_missing_and_mismatched_checkpoints_are_named(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="config.json is missing"):
        FlowPolicy.from_pretrained(tmp_path)
    small_policy().save_pretrained(tmp_path / "a")
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    config["hidden_dim"] = 64
    (tmp_path / "a" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="wrong_shape"):
        FlowPolicy.from_pretrained(tmp_path / "a")
    weights = tmp_path / "a" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])  # its data cut short
    with pytest.raises(CheckpointError, match="could not be read as safetensors"):
        FlowPolicy.from_pretrained(tmp_path / "a")
    weights.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="could not be read as safetensors"):
        FlowPolicy.from_pretrained(tmp_path / "a")
    config["type"] = "smolvla_typo"
    (tmp_path / "a" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="policy.type must be one of|unknown policy type"):
        FlowPolicy.from_pretrained(tmp_path / "a")


def test_random_init_is_refused_unless_allowed(tmp_path) -> None:
    policy = small_policy()
    with pytest.raises(RandomInitError, match="--allow-random-init"):
        require_pretrained(policy, allow_random_init=False)
    require_pretrained(policy, allow_random_init=True)
    policy.save_pretrained(tmp_path / "c")
    require_pretrained(FlowPolicy.from_pretrained(tmp_path / "c"), allow_random_init=False)


def test_broadcast_state_holds_only_trainable_parameters() -> None:
    policy = small_policy()
    for p in policy.velocity_net.parameters():
        p.requires_grad_(False)  # a frozen backbone is not re-sent after every update
    names = set(policy.broadcast_state())
    assert names and not any(n.startswith("velocity_net.") for n in names)
    assert "obs_mean" not in names


def test_a_crash_while_writing_keeps_the_previous_checkpoint(tmp_path) -> None:
    from common.policy import write_directory_atomically

    target = tmp_path / "ckpt"
    write_directory_atomically(target, lambda d: (d / "a.txt").write_text("v1"))

    def crash(directory):
        (directory / "a.txt").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_directory_atomically(target, crash)
    assert (target / "a.txt").read_text() == "v1"
    write_directory_atomically(target, lambda d: (d / "a.txt").write_text("v2"))
    assert (target / "a.txt").read_text() == "v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # leftovers from the crash are cleaned up


def test_out_of_distribution_states_saturate_instead_of_exploding() -> None:
    from common.policy import OBS_CLIP

    policy = small_policy()
    obs = torch.zeros(100, 39)
    obs[:, 10] = 1.0 + 0.003 * torch.randn(100)  # a quaternion element that barely moves in the demos
    policy.set_normalization(obs.mean(0), obs.std(0), torch.zeros(4), torch.ones(4))
    tipped = obs[:1].clone()
    tipped[0, 10] = 0.5  # the block knocked over during RL
    features = policy.encode(Observation(tipped))
    assert features.abs().max() <= OBS_CLIP
    assert features[0, 10] == -OBS_CLIP


def test_a_checkpoint_copied_through_its_contents_is_the_same_and_a_corrupt_copy_writes_nothing(tmp_path) -> None:
    """directory_contents / write_directory_contents carry a checkpoint between nodes (actors.run_files): the copy is
    the same files byte for byte, checksum listing included, and loads to the same weights; a file whose bytes no
    longer match the listing, or a name outside the directory, is refused and leaves nothing behind."""
    from common.storage import directory_contents, write_directory_atomically, write_directory_contents

    policy = small_policy()
    write_directory_atomically(tmp_path / "ckpt", policy.save_pretrained)  # as a learner checkpoint is written
    contents = directory_contents(tmp_path / "ckpt")
    assert {"model.safetensors", "config.json", "checksums.json"} <= set(contents)
    copy = write_directory_contents(tmp_path / "copy", contents)
    assert {k: v.tobytes() for k, v in directory_contents(copy).items()} == {k: v.tobytes() for k, v in contents.items()}
    for (name, a), (_, b) in zip(policy.state_dict().items(), FlowPolicy.from_pretrained(copy).state_dict().items()):
        assert torch.equal(a, b), name

    weights = contents["model.safetensors"].copy()
    weights[-1] ^= 1
    with pytest.raises(CheckpointError, match=r"model\.safetensors of .*bad does not match its sha256 in checksums\.json"):
        write_directory_contents(tmp_path / "bad", {**contents, "model.safetensors": weights})
    with pytest.raises(CheckpointError, match=r"'\.\./outside' is not a path inside the checkpoint"):
        write_directory_contents(tmp_path / "bad", {**contents, "../outside": weights[:1]})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "copy"]  # no copy, no temporary directory
