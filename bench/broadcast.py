"""Weight broadcast to N Ray actors: the project's path against the copy floor and against Ray's default
torch state_dict path, side by side in one run (one Ray instance, the same actors, the same payload).

    nice -n 5 python bench/broadcast.py                                  # N = 1, 4, 10 x 10MB, 100MB, 1GB, smolvla
    python bench/broadcast.py --actors 1 --sizes 1MB --repeats 1         # a smoke run, seconds

Each case is N actors x one payload (float32 tensors of at most 16 MB each; MB = 10^6 bytes). Three paths:
  - project: what learner/runtime/driver.py and actors/rollout_actor.py do. `Learner.broadcast` makes a
    `common.trajectory.WeightsPayload` (WeightsPayload.from_state, copy=False: numpy views of the learner's tensors), the
    learner publishes it with ONE `ray.put`, every actor receives the same reference and loads it with
    `RolloutActor.load_weights` itself (here bound to a stand-in actor holding tensors of the payload's shapes).
  - floor: one `ray.put` of the learner's tensors as numpy arrays, each actor copies them into its own
    tensors once (np.copyto): one put + one load per actor, the least any broadcast through the object store does.
  - state_dict: Ray's default when one passes a torch state_dict to every actor call: each call serialises the
    tensors again, each actor deserialises them and runs `load_state_dict`.
Seconds run from the learner holding its tensors to every actor having loaded them (median of --repeats after one
untimed round; the paths take turns first). `<path>_ratio_to_floor` = floor_seconds / <path>_seconds: 1.0 is the floor's speed;
the goal is >= 0.8 for the project's path at 1 GB and N = 4 (docs/performance.md).

The smolvla size is what `SmolVLAFlowPolicy.broadcast_bytes()` sends with configs/smolvla_pick.yaml's
trainable flags (action projections, time MLP, noise head, critic; VLM and expert frozen), built with
smolvla_base's widths (text 960, expert 720) over a one-layer offline VLM: no trainable tensor depends on the
depth, so the shapes are the real ones (8.7 MB). It needs the smolvla extra and lerobot; without them the case
is skipped with the reason printed.

Memory: a case runs only where its estimated peak (driver copies, object store, each actor's tensors and its
transient copy) fits in 75% of the memory available when it starts; otherwise that path is skipped with a
printed reason (1 GB x 10 actors does not fit a 24 GB machine).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import dataclasses
import gc
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import ray
import torch
from torch import nn

from actors.rollout_actor import RolloutActor
from bench.report import available_memory_bytes, emit, load_average, ratio
from common.trajectory import WeightsPayload
from learner.runtime.ray_runtime import start_local_ray

PATHS = ("floor", "project", "state_dict")
MAX_TENSOR_ELEMENTS = 4_000_000  # 16 MB of float32 per tensor
MEMORY_FRACTION = 0.75
STORE_FRACTION = 0.3  # of available memory, Ray's own default share for the object store
UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9}


def release_freed_memory() -> None:
    """Collect, then hand freed heap pages back to the OS (glibc keeps them otherwise, and the next case's memory
    check would see a machine fuller than it is)."""
    gc.collect()
    libc_name = ctypes.util.find_library("c")
    if libc_name and hasattr(ctypes.CDLL(libc_name), "malloc_trim"):
        ctypes.CDLL(libc_name).malloc_trim(0)


class Receiver:
    """Stands in for a RolloutActor: a parameter module of the payload's shapes, loaded by the real actor's
    `RolloutActor.load_weights` (the project's path) or by the floor's and state_dict's loaders."""

    load_weights = RolloutActor.load_weights

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.policy = nn.Module()
        self.version = -1

    def allocate(self, shapes: dict[str, tuple[int, ...]]) -> int:
        self.policy = nn.Module()
        release_freed_memory()
        for name, shape in shapes.items():
            self.policy.register_parameter(name, nn.Parameter(torch.zeros(shape)))
        self.version = -1
        return sum(p.numel() for p in self.policy.parameters())

    def load_project(self, weights: WeightsPayload) -> int:
        self.load_weights(weights)
        return self.version

    def load_floor(self, params: dict[str, np.ndarray]) -> int:
        for name, param in self.policy.named_parameters():
            np.copyto(param.detach().numpy(), params[name])
        return len(params)

    def load_torch_state_dict(self, state: dict[str, torch.Tensor]) -> int:
        self.policy.load_state_dict(state, strict=False)
        return len(state)


def parse_size(text: str) -> int:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(KB|MB|GB)", text)
    if not match:
        raise SystemExit(f"--sizes: {text!r} is not a size like 10MB, 1GB or 'smolvla'")
    return int(float(match.group(1)) * UNITS[match.group(2)])


def synthetic_shapes(num_bytes: int) -> dict[str, tuple[int, ...]]:
    """float32 tensors totalling num_bytes (rounded down to whole elements), none above 16 MB."""
    elements, shapes = num_bytes // 4, {}
    while elements > 0:
        size = min(elements, MAX_TENSOR_ELEMENTS)
        shapes[f"p{len(shapes):04d}"] = (size,)
        elements -= size
    return shapes


def smolvla_trainable_shapes() -> dict[str, tuple[int, ...]]:
    """The shapes SmolVLAFlowPolicy broadcasts under configs/smolvla_pick.yaml's trainable flags (module docstring)."""
    from common.config_loading import load_config
    from common.policy.smolvla.model import SmolVLAFlowPolicy
    from common.policy.smolvla.stand_ins import TinyVLMSpec, tiny_vlm_dir

    config = load_config(Path(__file__).resolve().parents[1] / "configs" / "smolvla_pick.yaml").policy
    # SmolVLM2-500M's text model: width 960, 15 heads, 5 key/value heads (the expert is 0.75 x 960 = 720 wide).
    vlm = tiny_vlm_dir(TinyVLMSpec(image_size=32, text_hidden=960, text_layers=1, text_heads=15, text_kv_heads=5))
    smolvla = dataclasses.replace(config.smolvla, vlm_path=str(vlm), lerobot_checkpoint="", num_vlm_layers=1)
    policy = SmolVLAFlowPolicy(dataclasses.replace(config, image_size=32, smolvla=smolvla))
    # Receivers name parameters p0000...: nn.Module attribute names cannot hold the dots of nested names.
    return {f"p{i:04d}": tuple(t.shape) for i, t in enumerate(policy.broadcast_state().values())}


def peak_bytes(path: str, payload: int, actors: int) -> tuple[int, int]:
    """(estimated peak memory, object store use) of one path. Every path: the learner's tensors and each actor's own.
    project: + the WeightsPayload copy until it is put, and the put (actors copy straight from the store's arrays).
    floor: + the put. state_dict: + one serialised copy per call in the store, one deserialised copy per actor."""
    base = payload + actors * payload
    if path == "floor":
        return base + payload, payload
    if path == "project":
        return base + payload + payload, payload
    return base + 2 * actors * payload, actors * payload


def timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def run_case(receivers: list, state: dict[str, torch.Tensor], paths: list[str], repeats: int, version: list[int]) -> dict[str, float]:
    """Median seconds per path after one untimed round (first touches of the object store's and the actors' pages),
    the paths taking turns going first so drifting load hits each alike."""

    def floor() -> None:
        ref = ray.put({name: tensor.numpy() for name, tensor in state.items()})
        ray.get([r.load_floor.remote(ref) for r in receivers])

    def project() -> None:
        version[0] += 1
        ref = ray.put(WeightsPayload.from_state(version[0], state, copy=False))
        loaded = ray.get([r.load_project.remote(ref) for r in receivers])
        if loaded != [version[0]] * len(receivers):
            raise RuntimeError(f"actors report weight versions {loaded}, expected {version[0]}")

    def state_dict() -> None:
        ray.get([r.load_torch_state_dict.remote(state) for r in receivers])

    runners = {"floor": floor, "project": project, "state_dict": state_dict}
    for path in paths:
        runners[path]()
    seconds: dict[str, list[float]] = {path: [] for path in paths}
    for repeat in range(repeats):
        turn = paths[repeat % len(paths) :] + paths[: repeat % len(paths)]
        for path in turn:
            seconds[path].append(timed(runners[path]))
    return {f"{path}_seconds": statistics.median(values) for path, values in seconds.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--actors", default="1,4,10", help="comma-separated actor counts N")
    parser.add_argument("--sizes", default="10MB,100MB,1GB,smolvla", help="comma-separated payload sizes (KB/MB/GB) or 'smolvla'")
    parser.add_argument("--repeats", type=int, default=3, help="timed broadcasts per path and case (the median is reported)")
    args = parser.parse_args(argv)
    try:
        actor_counts = sorted({int(n) for n in args.actors.split(",")})
    except ValueError:
        raise SystemExit(f"--actors must be comma-separated integers like 1,4,10, got {args.actors!r}") from None
    if actor_counts[0] < 1 or args.repeats < 1:
        raise SystemExit(f"--actors must be positive (got {args.actors!r}) and --repeats >= 1 (got {args.repeats})")
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    payloads: dict[str, dict[str, tuple[int, ...]]] = {}
    skipped: dict[str, str] = {}
    for size in sizes:
        if size == "smolvla":
            try:
                payloads[size] = smolvla_trainable_shapes()
            except ImportError as exc:  # the smolvla extra or lerobot is not installed
                skipped[size] = f"SmolVLA backend not importable ({exc}); install the smolvla extra and lerobot (README)"
        else:
            payloads[size] = synthetic_shapes(parse_size(size))

    available = available_memory_bytes()
    start_local_ray(num_cpus=2, include_dashboard=False, object_store_memory=int(STORE_FRACTION * available), log_to_driver=False)
    store_capacity = int(ray.available_resources().get("object_store_memory", STORE_FRACTION * available))
    try:
        receivers = [ray.remote(Receiver).options(num_cpus=0).remote() for _ in range(actor_counts[-1])]
        ray.get([r.allocate.remote({}) for r in receivers])  # started and imported before any timing
        results: dict = {"bench": "broadcast", "repeats": args.repeats, "load_average_1m": load_average(), "cases": {}, "skipped": skipped}
        version = [0]
        for size, shapes in payloads.items():
            generator = torch.Generator().manual_seed(0)
            state = {name: torch.rand(shape, generator=generator) for name, shape in shapes.items()}
            payload = sum(t.numel() * t.element_size() for t in state.values())
            for count in actor_counts:
                case = f"n{count}_{size}"
                ray.get([r.allocate.remote({}) for r in receivers])  # the previous case's tensors freed before measuring
                release_freed_memory()
                budget = MEMORY_FRACTION * available_memory_bytes()
                paths = []
                for path in PATHS:
                    peak, store = peak_bytes(path, payload, count)
                    if peak > budget or store > 0.9 * store_capacity:
                        reason = f"needs ~{peak / 1e9:.1f} GB (object store {store / 1e9:.1f} GB), have {budget / 1e9:.1f} GB "
                        skipped[f"{case}/{path}"] = reason + f"({MEMORY_FRACTION:.0%} of available; store {store_capacity / 1e9:.1f} GB)"
                        print(f"skipping {case}/{path}: {skipped[f'{case}/{path}']}", file=sys.stderr, flush=True)
                    else:
                        paths.append(path)
                if not paths:
                    continue
                ray.get([r.allocate.remote(shapes) for r in receivers[:count]])
                figures = run_case(receivers[:count], state, paths, args.repeats, version)
                floor_seconds = figures.get("floor_seconds")
                for path in ("project", "state_dict"):
                    if f"{path}_seconds" in figures:
                        figures[f"{path}_ratio_to_floor"] = ratio(floor_seconds, figures[f"{path}_seconds"])
                results["cases"][case] = {"actors": count, "payload_bytes": payload, **figures}
                print(f"{case}: {figures}", file=sys.stderr, flush=True)
            del state
            release_freed_memory()
    finally:
        ray.shutdown()
    emit(results)
    return results


if __name__ == "__main__":
    main()
