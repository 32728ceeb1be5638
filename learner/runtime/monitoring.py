"""What the Ray dashboard and Prometheus see: tagged gauges for every metric, and per-actor health.

Every numeric metric of an iteration becomes a `ray.util.metrics.Gauge` named `flowrl_<key>` (Prometheus
shows it as `ray_flowrl_<key>`), tagged with the task. Per-actor series use keys `actor/<i>/<name>` in
the metrics dict and become one gauge `flowrl_actor_<name>` with an `actor` tag, so a dashboard
panel draws one line per actor from one query:

    actor/<i>/weight_version            the weight version actor i sampled this iteration with
    actor/<i>/weight_version_lag        learner version minus that (0 in the synchronous loop)
    actor/<i>/env_steps                 env steps it took this iteration
    actor/<i>/env_steps_per_second      those steps over its own sampling time
    actor/<i>/alive                     1 while Ray reports the actor ALIVE, else 0
    actor/<i>/restarts                  how often Ray has restarted it (actors.faults.max_restarts)

A multi-task run's per-task keys `<section>/task/<task>/<name>` (eval/task/reach-v3/success_rate) set the gauge of
`<section>/<name>` tagged with that task, beside the run's own series, tagged with env.task (e.g. MT10).

The Grafana dashboard in cluster/grafana_dashboard.json is built over these names.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from common.trajectory import RolloutBatch

ACTOR_KEY = re.compile(r"^actor/(\d+)/(.+)$")
TASK_KEY = re.compile(r"^(.+)/task/([^/]+)/(.+)$")


def gauge_name(key: str) -> str:
    return "flowrl_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


def per_actor_metrics(batches: Sequence[RolloutBatch], learner_version: int) -> dict[str, float]:
    """Weight version, lag, env steps and env steps/s of each actor's batch of this iteration."""
    metrics = {}
    for batch in batches:
        prefix = f"actor/{batch.actor_index}/"
        metrics[prefix + "weight_version"] = float(batch.weight_version)
        metrics[prefix + "weight_version_lag"] = float(learner_version - batch.weight_version)
        metrics[prefix + "env_steps"] = float(batch.env_steps)
        metrics[prefix + "env_steps_per_second"] = batch.env_steps / batch.sample_seconds if batch.sample_seconds > 0 else math.nan
    return metrics


class GaugeExporter:
    """Sets one Ray gauge per metric key, tagged with the task and, for per-actor keys, the actor index."""

    def __init__(self, task: str):
        self.task = task
        self.gauges: dict[str, Any] = {}

    def _gauge(self, name: str, description: str, tag_keys: tuple[str, ...]) -> Any:
        from ray.util.metrics import Gauge

        if name not in self.gauges:
            self.gauges[name] = Gauge(name, description=description, tag_keys=tag_keys)
        return self.gauges[name]

    def export(self, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            per_actor, per_task = ACTOR_KEY.match(key), TASK_KEY.match(key)
            if per_task:
                section, task, name = per_task.groups()
                key = f"{section}/{name}"
                self._gauge(gauge_name(key), f"flowrl metric {key}", ("task",)).set(float(value), tags={"task": task})
            elif per_actor:
                index, name = per_actor.groups()
                gauge = self._gauge(gauge_name(f"actor/{name}"), f"flowrl per-actor {name}", ("task", "actor"))
                gauge.set(float(value), tags={"task": self.task, "actor": index})
            else:
                self._gauge(gauge_name(key), f"flowrl metric {key}", ("task",)).set(float(value), tags={"task": self.task})
