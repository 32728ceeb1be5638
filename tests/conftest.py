"""Test-wide settings: headless MuJoCo rendering must be chosen before mujoco is first imported."""

import os

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
