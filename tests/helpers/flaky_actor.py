"""A rollout-actor stand-in for the actor pool's fault tests, in a module of its own so that a Ray worker
starting it imports nothing heavy (the tests time calls in seconds)."""

from __future__ import annotations

import os
import time
from pathlib import Path


class Flaky:
    """Its first call dies (process exit) or hangs (sleeps for an hour), as `mode` says; after a restart it answers.
    Mode "slow_restart": the first call dies, and the restarted actor takes `seconds` to start, then `seconds` to answer
    each call (a VLA actor reloading its model, then sampling). Mode "slow": every call takes `seconds`, none fails (a
    long held-out evaluation on a slow machine)."""

    def __init__(self, marker: str, mode: str, seconds: float = 0.0):
        self.marker, self.mode, self.seconds = Path(marker), mode, seconds
        if mode == "slow_restart" and self.marker.exists():
            time.sleep(seconds)

    def pid(self) -> int:
        return os.getpid()

    def work(self, value: int) -> dict[str, int]:
        if self.mode in ("die", "hang", "slow_restart") and not self.marker.exists():
            self.marker.touch()
            if self.mode in ("die", "slow_restart"):
                os._exit(1)
            time.sleep(3600)
        if self.mode in ("slow_restart", "slow"):
            time.sleep(self.seconds)
        return {"env_steps": value, "pid": os.getpid()}


class Owner:
    """Puts a value into Ray's object store and owns it there, as the learner owns the weights it publishes."""

    def put(self, size: int) -> list:
        import ray

        return [ray.put(bytes(size))]  # in a list: Ray hands the caller the reference, not the value
