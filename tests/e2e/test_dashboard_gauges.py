"""A short local run: every Ray port stays on loopback, and the metrics endpoint serves tagged flowrl gauges."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import ray

from learner.main import run
from learner.runtime.monitoring import gauge_name
from learner.runtime.ray_runtime import start_local_ray
from tests.conftest import REPO, tiny_config

pytestmark = pytest.mark.usefixtures("no_ray")  # the run starts its own Ray, whose every listener is watched

GRAFANA = REPO / "cluster" / "grafana_dashboard.json"
SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)$")


def listening_sockets() -> dict[str, tuple[str, int]]:
    """Socket inode -> (address, port) of every TCP socket in LISTEN state, from /proc/net/tcp{,6}."""
    found = {}
    for family, table in ((socket.AF_INET, "/proc/net/tcp"), (socket.AF_INET6, "/proc/net/tcp6")):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # LISTEN
                continue
            address_hex, port_hex = fields[1].split(":")
            raw = bytes.fromhex(address_hex)  # little-endian 32-bit words
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found[fields[9]] = (socket.inet_ntop(family, raw), int(port_hex, 16))
    return found


def descendants(root: int) -> set[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
    tree, frontier = {root}, [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier and pid not in tree]
        tree.update(children)
        frontier = children
    return tree


def ray_listeners() -> set[tuple[int, str, int]]:
    """(pid, address, port) of every listening socket held by this process and the Ray processes it started."""
    sockets, held = listening_sockets(), set()
    for pid in descendants(os.getpid()):
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        held |= {(pid, *sockets[link[8:-1]]) for link in links if link.startswith("socket:[") and link[8:-1] in sockets}
    return held


def is_loopback(address: str) -> bool:
    parsed = ipaddress.ip_address(address)
    return parsed.is_loopback or (parsed.version == 6 and parsed.ipv4_mapped is not None and parsed.ipv4_mapped.is_loopback)


def scrape(port: int) -> list[tuple[str, dict[str, str], float]]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = []
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match and match["name"].startswith("ray_flowrl_"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match["labels"]))
            samples.append((match["name"], labels, float(match["value"])))
    return samples


def test_local_run_listens_on_loopback_only_and_exports_tagged_gauges(tmp_path, bc_checkpoint) -> None:
    config = tiny_config(tmp_path, init_checkpoint=str(bc_checkpoint), iterations=2)
    seen: set[tuple[int, str, int]] = set()
    stop = threading.Event()

    def watch() -> None:  # sample the listening sockets all through the run (actors come and go)
        while not stop.is_set():
            seen.update(ray_listeners())
            stop.wait(1.0)

    dashboard_port = int(start_local_ray(num_cpus=2, include_dashboard=True, log_to_driver=False).dashboard_url.rsplit(":", 1)[1])
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        run(config, include_dashboard=True)
        node = ray.nodes()[0]
        port, node_address = node["MetricsExportPort"], node["NodeManagerAddress"]
        wanted = {"ray_flowrl_losses_approx_kl", "ray_flowrl_actor_env_steps_per_second", "ray_flowrl_actor_alive"}
        samples: list = []
        deadline = time.monotonic() + 60  # gauges are exported every report interval (10 s by default)
        while time.monotonic() < deadline and not wanted <= {name for name, _, _ in samples}:
            time.sleep(2)
            samples = scrape(port)
    finally:
        stop.set()
        watcher.join()
        ray.shutdown()

    assert node_address == "127.0.0.1"
    assert len({pid for pid, _, _ in seen}) >= 4  # the driver, GCS, raylet, dashboard, agents and workers were watched
    assert any(port_ == dashboard_port for _, _, port_ in seen)  # the dashboard was up and watched
    exposed = sorted((address, port_) for _, address, port_ in seen if not is_loopback(address))
    assert not exposed, f"Ray listens beyond loopback on {exposed}"

    by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
    for name, labels, value in samples:
        by_name.setdefault(name, []).append((labels, value))
    assert {labels["task"] for series in by_name.values() for labels, _ in series} == {"pick-place-v3"}
    for name in ("ray_flowrl_losses_approx_kl", "ray_flowrl_losses_clipfrac", "ray_flowrl_rollout_env_steps", "ray_flowrl_ppo_ratio_max"):
        ((labels, _),) = by_name[name]  # one series per run-wide metric
        assert "actor" not in labels
    assert 0 <= by_name["ray_flowrl_losses_clipfrac"][0][1] <= 1
    assert by_name["ray_flowrl_rollout_env_steps"][0][1] > 0
    # The last iteration (2) was sampled with v0 while iteration 1 trained: the default actors.policy_lag=1.
    per_actor = {"ray_flowrl_actor_alive": (1, 1), "ray_flowrl_actor_restarts": (0, 0), "ray_flowrl_actor_weight_version_lag": (1, 1),
                 "ray_flowrl_actor_weight_version": (0, 0), "ray_flowrl_actor_env_steps_per_second": (1e-3, 1e7)}  # fmt: skip
    for name, (low, high) in per_actor.items():
        series = {labels["actor"]: value for labels, value in by_name[name]}
        assert sorted(series) == ["0", "1"], f"{name}: expected one series per actor, got {series}"
        assert all(low <= value <= high for value in series.values()), f"{name}: {series}"
    # The shipped Grafana dashboard queries only metrics that a run really exports (or logs as NaN: in this tiny
    # run no episode ends during a rollout, so rollout/success_rate is NaN and its gauge is not set).
    last_row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    nan_gauges = {"ray_" + gauge_name(key) for key, value in last_row.items() if value is None}  # the log writes NaN as null
    queried = set(re.findall(r"ray_flowrl_\w+", GRAFANA.read_text()))
    unknown = queried - set(by_name) - nan_gauges
    assert len(queried) >= 10 and not unknown, f"dashboard queries metrics no run exports: {sorted(unknown)}"
