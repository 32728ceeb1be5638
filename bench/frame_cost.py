"""What a Metaworld frame costs drawn fast (no shadows, reflections or multisampling) and with MuJoCo's default settings
(lerobot's: env.render default, the lerobot observations' own), side by side, and how far the fast frame is from the
default one, at the sizes a run draws.

X
    python bench/frame_cost.py --sizes 480 --frames 5   # a smoke run

One env of pick-place on its first training layout, stepped by random actions between frames; the cases take turns,
--rounds times, after an untimed frame each. `<size>_<fast|default>_ms_per_frame` is the median wall milliseconds of a
frame in one thread, `<size>_default_over_fast` their ratio. `<size>_fast_mean_abs_diff` (in 0-255 units) and
`<size>_fast_pixels_differ` compare the two drawings of the same simulator state; `<size>_fast_resized_<S>_mean_abs_diff`
after lerobot's resize_with_pad to a policy's S-pixel input (SmolVLA's), where a tiny backbone sees them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np
import torch

from bench.report import emit, load_average
from common.suites import ImageConfig
from common.suites.metaworld import MetaworldTaskEnv


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="480,224,64", help="square frame sides, comma-separated")
    parser.add_argument("--frames", type=int, default=20, help="frames per case and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--resized", type=int, default=64, help="the policy input side the difference is also measured at")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    sizes = [int(size) for size in args.sizes.split(",")]
    figures: dict[str, float] = {"bench": "frame_cost", "load_average_1m_start": load_average()}  # type: ignore[dict-item]
    cameras = [ImageConfig(size, size, "corner4", fast=fast) for size in sizes for fast in (True, False)]
    env = MetaworldTaskEnv("pick-place-v3", cameras=cameras, lerobot_observations=False)
    rng = np.random.default_rng(0)
    env.reset()
    timings: dict[int, list[list[float]]] = {index: [] for index in range(len(cameras))}
    try:
        for _ in range(args.rounds):
            for index, renderer in enumerate(env._cameras):
                renderer.render(env._env.data)  # untimed: the context's first frame
                took = []
                for _ in range(args.frames):
                    env.step(rng.uniform(-1, 1, 4).astype(np.float32))
                    start = time.perf_counter()
                    renderer.render(env._env.data)
                    took.append(1000 * (time.perf_counter() - start))
                timings[index].append(statistics.median(took))
        frames = env.render_cameras()
    finally:
        env.close()
    from common.policy.lerobot_compat import resize_with_pad

    def resized(frame: np.ndarray) -> np.ndarray:
        image = torch.from_numpy(frame).permute(2, 0, 1)[None].float() / 255.0
        return 255.0 * resize_with_pad(image, args.resized, args.resized, pad_value=0.0)[0].numpy()

    for position, size in enumerate(sizes):
        fast, default = 2 * position, 2 * position + 1
        fast_ms, default_ms = statistics.median(timings[fast]), statistics.median(timings[default])
        difference = np.abs(frames[fast].astype(float) - frames[default].astype(float))
        resized_difference = np.abs(resized(frames[fast]) - resized(frames[default]))
        figures |= {f"{size}_fast_ms_per_frame": fast_ms, f"{size}_default_ms_per_frame": default_ms,
                    f"{size}_default_over_fast": default_ms / fast_ms, f"{size}_fast_mean_abs_diff": float(difference.mean()),
                    f"{size}_fast_pixels_differ": float(difference.any(-1).mean()),
                    f"{size}_fast_resized_{args.resized}_mean_abs_diff": float(resized_difference.mean())}  # fmt: skip
    figures["load_average_1m_end"] = load_average()
    emit(figures)
    return figures


if __name__ == "__main__":
    main()
