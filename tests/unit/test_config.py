"""Config loading: defaults, YAML, overrides, and errors that name the field."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import yaml

from common.config import ConfigError, RunConfig
from common.config_loading import closest_field, load_config
from tests.conftest import REPO


def test_defaults_validate_and_fingerprint_is_stable() -> None:
    config = load_config()
    assert config == RunConfig()
    assert config.fingerprint() == load_config().fingerprint()
    assert config.fingerprint() != load_config(None, ["algorithm.clip_eps=0.03"]).fingerprint()


def test_yaml_file_and_overrides(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("algorithm:\n  clip_eps: 0.05\n  target_kl: null\nenv:\n  train_benchmark_seeds: [7, 8]\n")
    config = load_config(path, ["algorithm.actor_lr=1e-4", "actors.num_actors=3", "algorithm.minibatch_size=300"])
    assert config.algorithm.clip_eps == 0.05 and config.algorithm.target_kl is None
    assert config.env.train_benchmark_seeds == [7, 8]
    assert config.algorithm.actor_lr == 1e-4 and config.actors.num_actors == 3


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("learner.clip_epsilon=0.1", r"unknown field.*learner\.clip_epsilon"),
        ("algorithm.clip_eps=2", r"algorithm\.clip_eps must be in \(0, 1\)"),
        ("policy.log_prob_normalization=median", r"policy\.log_prob_normalization must be one of"),
        ("policy.sigma_min=0.5", r"policy\.sigma_min/sigma_max"),
        ("actors.num_actors=zero", r"actors\.num_actors must be int"),
        ("env.eval_benchmark_seeds=[2]", r"env\.eval_benchmark_seeds \[2\] also used for training"),
        ("algorithm.grad_accum=501", r"algorithm\.grad_accum \(501\) exceeds the decisions of the smallest minibatch \(500 of 1000"),
        ("algorithm.num_minibatches=0", r"algorithm\.num_minibatches must be > 0"),
        ("algorithm.minibatch_size=0", r"algorithm\.minibatch_size must be > 0 or null"),
        ("learner.faults.call_timeout_s=0", r"learner\.faults\.call_timeout_s must be > 0"),
        ("learner.faults.call_timeout_update_factor=-1", r"learner\.faults\.call_timeout_update_factor must be >= 0"),
        ("learner.speed.micro_batch_memory_gib=-1", r"learner\.speed\.micro_batch_memory_gib must be >= 0"),
        (
            "learner.speed.micro_batch_memory_gib=20",
            r"learner\.speed\.micro_batch_memory_gib reads a GPU's allocator: it needs learner\.num_gpus > 0",
        ),
        ("learner.sharding=zero3", r"learner\.sharding must be one of"),
        ("learner.sharding=fsdp", r"learner\.sharding=fsdp splits the policy over a learner group: it needs learner\.num_learners >= 2"),
        ("nonsense", r"must look like section\.field=value"),
        ("pretrain.task_demos={reach-v3: 0}", r"pretrain\.task_demos\['reach-v3'\] must be in \[1, 50\]"),
        ("pretrain.task_demos=[3]", r"pretrain\.task_demos must be a mapping"),
    ],
)
def test_bad_values_name_the_field(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize("knob", ["compile_steps", "compile_vision"])
def test_a_sharded_learner_refuses_a_compiled_graph_naming_both_fields(knob: str) -> None:
    with pytest.raises(ConfigError, match=rf"learner\.sharding=fsdp and learner\.speed\.{knob}: choose one"):
        load_config(None, ["learner.num_learners=2", "learner.sharding=fsdp", f"learner.speed.{knob}=true"])


def test_an_unknown_field_is_pointed_to_the_closest_one_its_own_section_first() -> None:
    assert closest_field("learner.clip_epsilon") == "algorithm.clip_eps"  # the section an old config misplaced it in
    assert closest_field("learner.precison") == "learner.speed.precision" and closest_field("actors.precison") == "actors.speed.precision"
    assert closest_field("policy.colour") is None


def test_missing_config_file_is_named(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_shipped_config_is_the_embedded_default_with_every_field_written_out() -> None:

    path = REPO / "configs" / "pick_place.yaml"
    assert load_config(path) == RunConfig()
    assert yaml.safe_load(path.read_text()) == RunConfig().to_dict()  # no field left to its default unseen


def test_the_gpu_node_config_keeps_the_default_budget_and_minibatches() -> None:
    """configs/gpu_node_16_cores.yaml: larger iterations, the same env-step budget (within one iteration) and the
    same optimiser steps per env step as the default (within one minibatch per epoch)."""

    gpu, default = load_config(REPO / "configs" / "gpu_node_16_cores.yaml"), RunConfig()

    def env_steps_per_iteration(config: RunConfig) -> int:
        return config.actors.num_actors * config.actors.envs_per_actor * config.actors.decisions_per_rollout * config.policy.chunk_size

    budget, gpu_iteration = default.iterations * env_steps_per_iteration(default), env_steps_per_iteration(gpu)
    assert budget <= gpu.iterations * gpu_iteration < budget + gpu_iteration
    gpu_steps, default_steps = (len(c.algorithm.minibatch_sizes(env_steps_per_iteration(c) // c.policy.chunk_size)) for c in (gpu, default))
    assert abs(gpu_steps - default_steps * gpu_iteration / env_steps_per_iteration(default)) < 1
    assert gpu.algorithm.update_epochs == default.algorithm.update_epochs
    assert (gpu.learner.num_gpus, gpu.actors.num_gpus) == (1, 0)


def _leaves(config, prefix: str = ""):
    """(dotted path, (value, type hint)) of every non-dataclass field, depth first."""
    import typing

    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", (value, hints[f.name])


def _changed(value, hint):
    """A value of the field's own type that differs from `value`."""
    import typing

    if value is None:  # an optional field: a value of the union's other member
        inner = next(a for a in typing.get_args(hint) if a is not type(None))
        return {int: 1, str: "x"}.get(inner, 0.5)
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, list):
        return [*value, "extra" if typing.get_args(hint)[0] is str else 99]
    if isinstance(value, dict):
        return {**value, "extra": {int: 1, str: "x"}.get(typing.get_args(hint)[1], 1.0)}
    return value + "_changed"


def test_an_override_changes_only_the_field_it_names() -> None:
    """Every leaf of RunConfig: `--set path=value` moves that path and leaves all others at the run defaults
    (a section rebuilt from its class defaults would undo what the run's defaults set in it)."""

    from common.config_loading import apply_override, from_dict

    defaults = dict(_leaves(RunConfig()))
    assert len(defaults) > 40  # the walk reaches every section
    for path, (value, hint) in defaults.items():
        data: dict = {}
        apply_override(data, f"{path}={json.dumps(_changed(value, hint))}")
        after = dict(_leaves(from_dict(RunConfig, data)))  # not validated: the changed value need not be sane
        moved = sorted(p for p in defaults if after[p][0] != defaults[p][0])
        assert moved == [path], f"--set {path}=... moved {moved}"


def epoch_plan(config: RunConfig, decisions: int, seed: int = 0) -> list[torch.Tensor]:
    """One epoch's minibatches as the learner draws them: a shuffle of the decisions split by algorithm.minibatch_sizes."""
    return list(torch.randperm(decisions, generator=torch.Generator().manual_seed(seed)).split(config.algorithm.minibatch_sizes(decisions)))


SHAPES = [{"actors.num_actors": n} for n in (1, 2, 3, 4, 7, 16)] + [
    {"actors.num_actors": 3, "actors.envs_per_actor": 1},
    {"actors.num_actors": 1, "actors.envs_per_actor": 1, "actors.decisions_per_rollout": 2},
    {"actors.num_actors": 5, "actors.envs_per_actor": 3, "actors.decisions_per_rollout": 7},
    {"actors.num_actors": 16, "actors.envs_per_actor": 8, "actors.decisions_per_rollout": 13},
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: "-".join(str(v) for v in shape.values()))
@pytest.mark.parametrize("sizing", [[], ["algorithm.num_minibatches=3"], ["algorithm.minibatch_size=64"]], ids=["default", "3mb", "size64"])
def test_every_rollout_shape_is_accepted_and_each_epoch_uses_every_decision_once(shape: dict[str, int], sizing: list[str]) -> None:
    overrides = [f"{key}={value}" for key, value in shape.items()] + sizing
    decisions = math.prod(
        shape.get(f"actors.{k}", getattr(RunConfig().actors, k)) for k in ("num_actors", "envs_per_actor", "decisions_per_rollout")
    )
    if sizing == ["algorithm.minibatch_size=64"] and decisions < 64:
        with pytest.raises(
            ConfigError, match=rf"algorithm\.minibatch_size \(64\) exceeds the decisions of one rollout \({decisions} = actors\.num_actors"
        ):
            load_config(None, overrides)
        return
    config = load_config(None, overrides)
    minibatches = epoch_plan(config, decisions)
    assert sorted(torch.cat(minibatches).tolist()) == list(range(decisions))  # each decision exactly once
    sizes = [len(mb) for mb in minibatches]
    assert min(sizes) >= max(sizes) - 1 >= 0  # no short leftover
    if config.algorithm.minibatch_size is None:
        assert len(sizes) == min(config.algorithm.num_minibatches, decisions)
    else:
        assert max(sizes) <= 64 and len(sizes) == math.ceil(decisions / 64)


def test_the_default_update_is_two_minibatches_of_500() -> None:
    config = RunConfig()
    assert config.algorithm.minibatch_sizes(1000) == [500, 500] and config.algorithm.minibatch_size is None
    # GRPO's batch shrinks when it drops incomplete groups: the count stays, the sizes follow.
    assert config.algorithm.minibatch_sizes(999) == [500, 499]


@pytest.mark.parametrize(
    "argv", [["--num-actors", "4"], ["--num-actors", "1"], ["--num-actors", "3"], ["--single-batch", "--num-actors", "2"]]
)
def test_the_main_commands_actor_counts_are_accepted(argv: list[str]) -> None:
    from learner.main import parse_args, resolve_config

    config = resolve_config(parse_args(argv))
    assert config.actors.num_actors == int(argv[-1])
    decisions = config.actors.num_actors * 100
    assert config.algorithm.minibatch_sizes(decisions) == [decisions // 2] * 2


def test_an_explicit_minibatch_plan_that_cannot_work_names_both_fields() -> None:
    with pytest.raises(
        ConfigError, match=r"algorithm\.minibatch_size \(300\) exceeds the decisions of one rollout \(200 = actors\.num_actors"
    ):
        load_config(None, ["actors.num_actors=2", "algorithm.minibatch_size=300"])
    with pytest.raises(
        ConfigError, match=r"algorithm\.grad_accum \(40\) exceeds .* smallest minibatch \(33 of 100, algorithm\.num_minibatches"
    ):
        load_config(None, ["actors.num_actors=1", "algorithm.num_minibatches=3", "algorithm.grad_accum=40"])


@pytest.mark.parametrize(("policy_type", "shown"), [("mlp_flow", None), ("smolvla", "smolvla"), ("pi0", "pi0"), ("pi05", "pi0")])
def test_the_banner_keeps_the_section_the_backend_reads_and_only_that_one(policy_type: str, shown: str | None) -> None:
    from common.config import PolicyConfig

    policy = PolicyConfig(type=policy_type, obs_dim=8, image_size=0 if policy_type == "mlp_flow" else 32)
    policy.validate()
    assert policy.vla_section() == shown
    assert sorted(policy.unused_sections()) == sorted({"smolvla", "pi0"} - {shown})


def test_a_vla_backend_registered_in_one_record_is_validated_shown_and_built_as_its_record_says(monkeypatch) -> None:
    """One record in common.policy.registry.BACKENDS is the whole declaration: the type is accepted, the section it
    names is the one validated against and shown, the class is imported from its record, and no lerobot type means
    nothing to export."""
    from common.config import PolicyConfig
    from common.policy import BACKENDS, Backend, policy_class

    monkeypatch.setitem(BACKENDS, "my_vla", Backend("common.policy.mlp:MLPFlowPolicy", section="pi0"))
    with pytest.raises(ConfigError, match=r"policy.image_size must be > 0 for policy.type my_vla"):
        PolicyConfig(type="my_vla").validate()
    with pytest.raises(ConfigError, match=r"policy.pi0.max_state_dim"):
        PolicyConfig(type="my_vla", image_size=32, obs_dim=PolicyConfig().pi0.max_state_dim + 1).validate()
    policy = PolicyConfig(type="my_vla", obs_dim=8, image_size=32)
    policy.validate()
    assert policy.unused_sections() == ["smolvla"]
    assert policy_class("my_vla").__name__ == "MLPFlowPolicy" and BACKENDS["my_vla"].lerobot_type is None
    with pytest.raises(ConfigError, match=r"policy.type must be one of \[.*'my_vla'.*\], got 'other'"):
        PolicyConfig(type="other").validate()


def test_the_config_reference_is_the_schema_as_it_is() -> None:
    """docs/reference/config.md is generated from the schema (python -m common.config_reference): every field of every
    section with its type, default and comment; a field added, renamed, re-typed or re-documented without the page
    regenerated fails here."""
    from common.config_reference import reference

    page = (REPO / "docs" / "reference" / "config.md").read_text()
    assert page == reference(), "regenerate it: python -m common.config_reference > docs/reference/config.md"

    def leaves(config) -> int:
        return sum(leaves(value) if dataclasses.is_dataclass(value := getattr(config, f.name)) else 1 for f in dataclasses.fields(config))

    assert page.count("\n| `") == leaves(RunConfig())  # one row per field, each with its text
    assert "|  |\n" not in page
