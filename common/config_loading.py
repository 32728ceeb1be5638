"""Reading a run configuration: YAML files, `--set section.field=value` overrides, and the typed build of the
schema's dataclasses (common.config) from nested dicts.

`load_config` is the one entry point for a run: defaults, then the YAML file, then the overrides, then
`RunConfig.validate()`. `from_dict` rejects unknown keys and wrong types by their dotted name, so a typo such as
`clip_epsilon` never silently falls back to a default.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from common.config import ConfigError, RunConfig
from common.lerobot_checkpoint import with_checkpoint_features


def from_dict(cls: type, data: dict[str, Any], path: str = "", base: Any = None) -> Any:
    """Build dataclass `cls` from a nested dict, rejecting unknown keys and wrong types by name.

    Fields absent from `data` keep their values in `base` (default: `cls()`), and nested sections start
    from the enclosing default's section, not from the section class's own defaults, so that an override such as
    `--set policy.sigma_max=0.2` changes sigma_max alone, whatever a recipe set beside it.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        hints = [f"{_join(path, k)} -> {match}?" for k in unknown if (match := closest_field(_join(path, k))) is not None]
        meant = f" (did you mean {', '.join(hints)})" if hints else ""
        named = [_join(path, k) for k in unknown]
        raise ConfigError(f"unknown field(s) {named}{meant}; known fields of {path or 'the config'}: {sorted(known)}")
    base = cls() if base is None else base
    kwargs = {name: _coerce(hints[name], value, _join(path, name), getattr(base, name)) for name, value in data.items()}
    return dataclasses.replace(base, **kwargs)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _coerce(hint: Any, value: Any, path: str, default: Any = None) -> Any:
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, path, default if isinstance(default, hint) else None)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, path)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path} must be a mapping, got {value!r}")
        key_hint, value_hint = typing.get_args(hint)
        return {_coerce(key_hint, k, f"{path}.{k}"): _coerce(value_hint, v, f"{path}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path} must be a list, got {value!r}")
        (item,) = typing.get_args(hint)
        return [_coerce(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"{path} must be float, got {value!r}") from None
    if hint is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{path} must be a finite number, got {value!r}")
    if hint in (int, float, str, bool) and not (isinstance(value, hint) and not (hint is int and isinstance(value, bool))):
        raise ConfigError(f"{path} must be {hint.__name__}, got {value!r}")
    return value


def _yaml_problem(error: yaml.YAMLError) -> str:
    """A YAML parse error in one line: what is wrong, and where."""
    mark = getattr(error, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return " ".join(f"{getattr(error, 'problem', None) or error}{where}".split())  # an undecodable byte's message spans lines


def read_yaml_file(path: Path, what: str) -> Any:
    """The YAML document in the file at `path` (None when it is empty); ConfigError naming `what` and the file, and
    the line of a syntax error, when it is missing or not YAML."""
    if not path.is_file():
        raise ConfigError(f"{what} {path} does not exist")
    try:
        return yaml.safe_load(path.read_bytes())  # bytes: PyYAML reports a bad encoding as a YAMLError too
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {path} is not valid YAML: {_yaml_problem(exc)}") from None


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply `a.b.c=value` (value parsed as YAML) to a nested dict in place."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like section.field=value")
    key, raw = override.split("=", 1)
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {part} is not a section")
    try:
        node[parts[-1]] = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {override!r}: the value is not valid YAML ({_yaml_problem(exc)})") from None


def load_config(path: str | Path | Sequence[str | Path] | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Defaults, then the YAML file at `path` (if any; several are layered, each file's fields over the earlier ones':
    a recipe, then a site's resources and paths), then `overrides`, then the sizes the suite knows where neither sets
    them (with_suite_sizes); validated."""
    paths = [] if path is None else [Path(path)] if isinstance(path, (str, Path)) else [Path(p) for p in path]
    data: dict[str, Any] = {}
    for file in paths:
        loaded = read_yaml_file(file, "config file")
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {file} must hold a mapping at top level")
        layered(data, loaded or {})
    for override in overrides:
        apply_override(data, override)
    try:
        config = from_dict(RunConfig, data)
    except TypeError as exc:  # a section given a scalar, for instance
        raise ConfigError(f"{', '.join(map(str, paths)) or 'config'}: {exc}") from exc
    given = set(flatten(data))
    config = with_suite_sizes(with_checkpoint_features(config, given), given)
    config.validate()
    return config


def layered(data: dict[str, Any], over: dict[str, Any], schema: type = RunConfig) -> None:
    """`over`'s fields into `data`, a config section of `schema` in both layered in turn; any other value (a mapping
    such as actors.resources included) replaced whole."""
    hints = typing.get_type_hints(schema)
    for key, value in over.items():
        section = hints.get(key)
        if dataclasses.is_dataclass(section) and isinstance(value, dict) and isinstance(data.get(key), dict):
            layered(data[key], value, section)
        else:
            data[key] = copy.deepcopy(value)


SUITE_SIZES = ("obs_dim", "action_dim", "action_bounds")


def with_suite_sizes(config: RunConfig, given: set[str]) -> RunConfig:
    """`config` with the policy's input and output widths the suite's (its state as env.observations gives it, with a
    multi-task run's one-hot, and its actions), and its actions' env units, where `given`, the dotted fields a file
    or override set, leaves them: a recipe for one task list runs on another unchanged. An env section the suite
    refuses is left for the run's checks to name (Suite.check)."""
    missing = [name for name in SUITE_SIZES if f"policy.{name}" not in given]
    if not missing:
        return config
    from common.suites import make_suite  # a suite's module imports its simulator

    try:
        suite = make_suite(config.env)
        task = suite.tasks()[0]
        sizes = {"obs_dim": suite.state_dim(), "action_dim": suite.sizes(task)[1], "action_bounds": suite.action_bounds(task)}
    except ValueError:  # ConfigError included
        return config
    return dataclasses.replace(config, policy=dataclasses.replace(config.policy, **{name: sizes[name] for name in missing}))


# Fields whose values are mappings, not sections: flatten keeps each whole, as one field.
MAPPING_FIELDS = ("resources", "task_demos", "rename_map")


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"algorithm": {"clip_eps": 0.02}} -> {"algorithm.clip_eps": 0.02}."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and not key.endswith(MAPPING_FIELDS):
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def closest_field(dotted: str) -> str | None:
    """The run schema's field whose name is closest to `dotted`'s last part, in any section (an old config may name a
    field in another section), preferring `dotted`'s own section, then its subsections; None when no name is close."""
    fields = [name for name in flatten(RunConfig().to_dict()) if name != dotted]
    section, _, leaf = dotted.rpartition(".")
    close = difflib.get_close_matches(leaf, sorted({name.rpartition(".")[2] for name in fields}), n=1, cutoff=0.75)
    if not close:
        return None
    candidates = [name for name in fields if name.rpartition(".")[2] == close[0]]
    return max(candidates, key=lambda name: (name.rpartition(".")[0] == section, name.startswith(f"{section}.")))


def fields_of(config: RunConfig) -> set[str]:
    """Every dotted field name of a RunConfig (for validating --allow-config-change)."""
    return set(flatten(dataclasses.asdict(config)))
