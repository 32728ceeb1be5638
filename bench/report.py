"""Shared by the bench/ scripts: the repo on the import path (of Ray workers too), and the output: one JSON object,
then the same figures as `name: value` lines."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


def put_repo_on_path() -> None:
    """`python bench/x.py` puts bench/ first on sys.path, not the repo; Ray workers started afterwards inherit
    PYTHONPATH, so actors can import the project's modules (actors.rollout_actor, common.*) as the driver does."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO_ROOT) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *paths])


def flatten(results: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a/b": 1}: the `name: value` lines name nested figures by their path."""
    flat: dict[str, Any] = {}
    for key, value in results.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}/"))
        else:
            flat[name] = value
    return flat


def emit(results: dict[str, Any]) -> None:
    print(json.dumps(results, sort_keys=True), flush=True)
    for name, value in flatten(results).items():
        print(f"{name}: {value}", flush=True)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None (JSON null) when either figure is missing or the denominator is not positive."""
    if numerator is None or denominator is None or not (math.isfinite(numerator) and math.isfinite(denominator)) or denominator <= 0:
        return None
    return numerator / denominator


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping or evicting), or 0 if unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def load_average() -> float:
    """The 1-minute load average: a bench on a shared machine says how busy it was."""
    return os.getloadavg()[0]
