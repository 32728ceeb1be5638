"""Shared by the bench/ scripts: the output (one JSON object, then the same figures as `name: value` lines), ratios, and
the machine's load and memory around a measurement."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]


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


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds so far) of a live process, from /proc/<pid>/stat; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            text = stat.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after the command name, which may hold spaces and parentheses
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # ppid; utime + stime


def _title(pid: int) -> str:
    """A process's command line, or the title it set (Ray's workers: "ray::RolloutActor.sample")."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class ProcessTreeCPU:
    """CPU seconds spent by a process and its descendants while the block runs, summed by kind, read from Linux's
    /proc in a thread every `interval` seconds. A process counts with its last reading: what it spends in its last
    interval before exiting is missed, and one that lives less than an interval is not seen. Processes already
    alive when the block starts count from their CPU at that moment. kind_of(pid, title) names a process's kind, or
    None while its title does not tell (a Ray worker not yet given work, a process gone): it then keeps the kind it
    had, or "other"."""

    def __init__(self, root_pid: int, kind_of: Callable[[int, str], str | None], interval: float = 0.2) -> None:
        if not os.path.isdir(f"/proc/{root_pid}"):
            raise RuntimeError(f"reading CPU by process needs Linux's /proc (no /proc/{root_pid})")
        self.root_pid, self.kind_of, self.interval = root_pid, kind_of, interval
        self.readings: dict[int, tuple[str, float]] = {}  # pid -> (kind, CPU seconds since the block started)
        self.baseline: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="process-tree-cpu", daemon=True)

    def __enter__(self) -> ProcessTreeCPU:
        self.baseline = {pid: cpu for pid, (_, cpu) in self._tree().items()}
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._read()

    def by_kind(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for kind, cpu in self.readings.values():
            totals[kind] = totals.get(kind, 0.0) + cpu
        return totals

    def _tree(self) -> dict[int, tuple[int, float]]:
        stats = {int(name): stat for name in os.listdir("/proc") if name.isdigit() and (stat := _stat(int(name))) is not None}
        children: dict[int, list[int]] = {}
        for pid, (parent, _) in stats.items():
            children.setdefault(parent, []).append(pid)
        tree, pending = {}, [self.root_pid]
        while pending:
            pid = pending.pop()
            if pid in stats:
                tree[pid] = stats[pid]
                pending += children.get(pid, [])
        return tree

    def _read(self) -> None:
        for pid, (_, cpu) in self._tree().items():
            held = self.readings.get(pid)
            kind = self.kind_of(pid, _title(pid)) or (held[0] if held else "other")
            self.readings[pid] = (kind, cpu - self.baseline.get(pid, 0.0))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._read()


def record_arrays(record: Any, prefix: str = "") -> dict[str, np.ndarray]:
    """Every numpy array of a record (a dataclass such as RolloutBatch), nested records included, by dotted field name."""
    found = {}
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        if isinstance(value, np.ndarray):
            found[prefix + field.name] = value
        elif dataclasses.is_dataclass(value):
            found |= record_arrays(value, f"{prefix}{field.name}.")
    return found
