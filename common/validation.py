"""The checks each config section applies to its own fields: each failure is a ConfigError whose message names the field (its dotted
path) and how to fix it. Free of torch and of the schema, so that every backend's config module can use them."""

from __future__ import annotations

import re
from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field (dotted path) and the fix."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")  # a model repository's owner/name on the Hugging Face hub


def require_hub_id(value: str, what: str) -> None:
    """`value` is a hub repository id (owner/name), not a local path."""
    example = "HuggingFaceTB/SmolVLM2-500M-Video-Instruct"
    require(bool(HUB_ID.fullmatch(value)), f"{what} must be a hub id as owner/name (e.g. {example}), got {value!r}")


def require_positive(obj: Any, path: str, *names: str) -> None:
    prefix = f"{path}." if path else ""
    for name in names:
        value = getattr(obj, name)
        require(value > 0, f"{prefix}{name} must be > 0, got {value}")


def require_choice(obj: Any, path: str, name: str, allowed: tuple[str, ...]) -> None:
    value = getattr(obj, name)
    require(value in allowed, f"{path}.{name} must be one of {allowed}, got {value!r}")
