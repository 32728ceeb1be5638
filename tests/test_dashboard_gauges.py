"""Every iteration's metrics reach the Ray dashboard's Prometheus endpoint as flowrl_* gauges."""

from __future__ import annotations

import time
import urllib.request

import pytest
import ray

from learner.main import run
from tests.conftest import tiny_config

pytestmark = pytest.mark.slow


def test_metrics_are_exported_as_ray_gauges(tmp_path, bc_checkpoint) -> None:
    config = tiny_config(tmp_path, init_checkpoint=str(bc_checkpoint), iterations=1)
    ray.init(num_cpus=2, include_dashboard=True, log_to_driver=False)
    try:
        run(config, include_dashboard=True)
        port = ray.nodes()[0]["MetricsExportPort"]
        names: set[str] = set()
        deadline = time.monotonic() + 60  # gauges are exported every report interval (10 s by default)
        while time.monotonic() < deadline and "ray_flowrl_losses_approx_kl" not in names:
            time.sleep(2)
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            names = {line.split("{")[0] for line in text.splitlines() if line.startswith("ray_flowrl_")}
    finally:
        ray.shutdown()
    expected = {"losses_approx_kl", "losses_clipfrac", "ppo_ratio_min", "ppo_ratio_max", "logprob_per_element",
                "rollout_env_steps", "time_env_steps_per_second", "rollout_weight_version_lag"}  # fmt: skip
    assert {f"ray_flowrl_{name}" for name in expected} <= names
