"""Config loading: defaults, YAML, overrides, and errors that name the field."""

from __future__ import annotations

import pytest

from common.config import ConfigError, RunConfig, load_config


def test_defaults_validate_and_fingerprint_is_stable() -> None:
    config = load_config()
    assert config == RunConfig()
    assert config.fingerprint() == load_config().fingerprint()
    assert config.fingerprint() != load_config(None, ["learner.clip_eps=0.03"]).fingerprint()


def test_yaml_file_and_overrides(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("learner:\n  clip_eps: 0.05\n  target_kl: null\nenv:\n  train_benchmark_seeds: [7, 8]\n")
    config = load_config(path, ["learner.actor_lr=1e-4", "actors.num_actors=3"])
    assert config.learner.clip_eps == 0.05 and config.learner.target_kl is None
    assert config.env.train_benchmark_seeds == [7, 8]
    assert config.learner.actor_lr == 1e-4 and config.actors.num_actors == 3


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("learner.clip_epsilon=0.1", r"unknown field.*learner\.clip_epsilon"),
        ("learner.clip_eps=2", r"learner\.clip_eps must be in \(0, 1\)"),
        ("policy.log_prob_normalization=median", r"policy\.log_prob_normalization must be one of"),
        ("policy.sigma_min=0.5", r"policy\.sigma_min/sigma_max"),
        ("actors.num_actors=zero", r"actors\.num_actors must be int"),
        ("env.eval_benchmark_seeds=[2]", r"env\.eval_benchmark_seeds \[2\] also used for training"),
        ("learner.grad_accum=3", r"divisible by learner\.grad_accum"),
        ("nonsense", r"must look like section\.field=value"),
    ],
)
def test_bad_values_name_the_field(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_missing_config_file_is_named(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_shipped_config_is_the_embedded_default() -> None:
    from pathlib import Path

    assert load_config(Path(__file__).parents[1] / "configs" / "pick_place.yaml") == RunConfig()
