"""What it takes to rerun a run bit for bit, written into every run's summary.json.

Runs are bit-reproducible per seed on the same software (rollouts depend only on the weights, the run seed, the
iteration and the actor index; the minibatch shuffle only on the seed and the iteration). The manifest records
everything else a rerun must match: package versions, the code's git commit, the resolved config, the identity of
the held-out layouts, and the hash of the starting checkpoint.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from common.config import RunConfig
from common.file_digests import file_sha256
from common.policy import WEIGHTS_FILE
from common.suites import Layout
from learner.bc.training import REPORT_FILE

REPO_ROOT = Path(__file__).resolve().parents[1]
# The packages whose versions change what a run computes (lerobot and transformers only when installed).
PACKAGES = ("torch", "numpy", "ray", "metaworld", "mujoco", "gymnasium", "safetensors", "lerobot", "transformers", "flowrl")


def package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def git_state(root: Path = REPO_ROOT) -> dict[str, Any]:
    """The commit the code came from and whether tracked files differ from it (None outside a git checkout)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True, timeout=10).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def reproducibility_manifest(config: RunConfig, init_checkpoint: Path | None, eval_layouts: Sequence[Layout]) -> dict[str, Any]:
    checkpoint: dict[str, Any] | None = None
    if init_checkpoint is not None:
        checkpoint = {"path": str(init_checkpoint), "weights_sha256": file_sha256(init_checkpoint / WEIGHTS_FILE)}
        report = init_checkpoint / REPORT_FILE
        if report.is_file():
            data = json.loads(report.read_text())
            checkpoint["pretrain"] = {k: data.get(k) for k in ("demos", "eval_success_rate", "eval_success_95ci", "eval_layouts")}
    return {
        "command": sys.argv,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": package_versions(),
        "git": git_state(),
        "config_fingerprint": config.fingerprint(),
        "config": config.to_dict(),
        "held_out_layouts": {
            "task": config.env.task,
            "tasks": list(dict.fromkeys(x.task for x in eval_layouts)),
            "benchmark_seed_and_index": [[x.benchmark_seed, x.index] for x in eval_layouts],
        },
        "init_checkpoint": checkpoint,
    }
