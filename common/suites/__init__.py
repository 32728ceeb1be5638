"""The environment suites the loop can train on: one module each, one line each here (env.suite names the line).

Each module is imported only when a run uses its suite, so a machine needs only the simulators it runs.
"""

from __future__ import annotations

import importlib

from common.config import ConfigError, EnvConfig
from common.suites.base import Expert, ImageConfig, Layout, Suite, SuiteEnv

SUITE_CLASSES = {
    "metaworld": "common.suites.metaworld:MetaworldSuite",
    "gym": "common.suites.gym_env:GymSuite",
    "libero": "common.suites.libero:LiberoSuite",
}


def make_suite(config: EnvConfig) -> Suite:
    """The suite env.suite names, built from the env section."""
    if config.suite not in SUITE_CLASSES:
        raise ConfigError(f"env.suite {config.suite!r} is not one of {sorted(SUITE_CLASSES)}")
    module, name = SUITE_CLASSES[config.suite].split(":")
    return getattr(importlib.import_module(module), name)(config)


def build_layout_tables(config: EnvConfig, task_seeds: list[tuple[str, int]]) -> dict:
    """The suite's layout tables of these (task, seed) pairs (a run's start-up builds them in Ray tasks, which import
    no more than this module and the suite's)."""
    return make_suite(config).layout_tables(task_seeds)


__all__ = ["Expert", "ImageConfig", "Layout", "Suite", "SuiteEnv", "SUITE_CLASSES", "build_layout_tables", "make_suite"]
