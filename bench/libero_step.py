"""The CPU cost of a LIBERO step, state only and with both cameras at policy sizes.

    python bench/libero_step.py                                  # libero_spatial's first task, 64/128/224/256 px
    python bench/libero_step.py --sizes 32 --decisions 2 --rounds 1  # a smoke run

One env of the task (common.suites.libero) per case, stepped with uniform random actions in chunks of --chunk steps,
as the loop steps it: one render of both cameras ("agentview" and "wrist") per chunk decision, none on the steps
between. The cases take turns, --rounds times, after an untimed warm-up decision; each figure is the median of its
rounds, in CPU milliseconds of this process (all its threads: the CPU rasteriser draws in several):
  - `state_ms_per_step`: a step without cameras (robosuite's physics and observables, LIBERO's goal check);
  - `<size>px_render_ms`: drawing both cameras once, at size x size; `<size>px_ms_per_decision`: a chunk decision's
    steps and its one render; `<size>px_ms_per_step`: that over the chunk's steps;
  - `<size>px_shadows_render_ms` (largest size): the same render with shadows and reflections on, which the suite
    turns off;
  - `reset_ms`: one reset to a training layout (LIBERO's samplers, then its 10 settling steps).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("MUJOCO_GL", "egl")  # before MuJoCo's import, which fixes its GL backend (as common.suites.libero)

import mujoco
import numpy as np

from bench.report import emit, load_average
from common.config import EnvConfig
from common.suites import ImageConfig, Layout, make_suite
from common.suites.libero import LiberoTaskEnv

DEFAULT_TASK = "pick_up_the_black_bowl_between_the_plate_and_the_ramekin_and_place_it_on_the_plate"


class Case:
    """One env: its cameras (none, or both at one size), stepped in chunk decisions."""

    def __init__(self, task: str, size: int | None, chunk: int, shadows: bool = False) -> None:
        suite = make_suite(EnvConfig(suite="libero", task=task))
        cameras = [] if size is None else [ImageConfig(size, size, name) for name in ("agentview", "wrist")]
        self.env: LiberoTaskEnv = suite.make_env(task, cameras=cameras)
        for view in self.env._cameras:
            for flag in (mujoco.mjtRndFlag.mjRND_SHADOW, mujoco.mjtRndFlag.mjRND_REFLECTION):
                view.renderer.scene.flags[flag] = int(shadows)
        self.chunk = chunk
        self.rng = np.random.default_rng(0)
        self.env.reset()

    def run(self, decisions: int) -> tuple[float, float]:
        """CPU milliseconds per step and per render of both cameras, over `decisions` chunk decisions."""
        step_cpu = render_cpu = 0.0
        steps = 0
        for _ in range(decisions):
            if self.env.num_cameras:
                began = time.process_time()
                self.env.render_cameras()
                render_cpu += time.process_time() - began
            for action in self.rng.uniform(-1.0, 1.0, size=(self.chunk, 7)):
                began = time.process_time()
                _, _, terminated, truncated, _ = self.env.step(action)
                step_cpu += time.process_time() - began
                steps += 1
                if terminated or truncated:
                    self.env.reset()
                    break
        return step_cpu / steps * 1e3, render_cpu / decisions * 1e3

    def reset_ms(self, resets: int) -> float:
        began = time.process_time()
        for index in range(resets):
            self.env.reset(options={"layout": Layout(self.env.task, 2, index)})
        return (time.process_time() - began) / resets * 1e3


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default=DEFAULT_TASK, help="a LIBERO task")
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 224, 256], help="camera sizes (square, px)")
    parser.add_argument("--chunk", type=int, default=4, help="steps per chunk decision")
    parser.add_argument("--decisions", type=int, default=10, help="chunk decisions per case and round")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per case (the cases take turns)")
    args = parser.parse_args(argv)
    if min(args.sizes) < 1 or args.chunk < 1 or args.decisions < 1 or args.rounds < 1:
        raise SystemExit("--sizes, --chunk, --decisions and --rounds must be >= 1")
    cases = {"state": Case(args.task, None, args.chunk)}
    cases |= {f"{size}px": Case(args.task, size, args.chunk) for size in args.sizes}
    cases[f"{max(args.sizes)}px_shadows"] = Case(args.task, max(args.sizes), args.chunk, shadows=True)
    results: dict = {"bench": "libero_step", "task": args.task, "chunk": args.chunk, "load_average_1m_start": load_average()}
    for case in cases.values():
        case.run(1)  # untimed warm-up
    rounds: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, case in cases.items():
            rounds[name].append(case.run(args.decisions))
    results["state_ms_per_step"] = statistics.median(step for step, _ in rounds.pop("state"))
    for name, values in rounds.items():
        step, render = statistics.median(step for step, _ in values), statistics.median(render for _, render in values)
        results[f"{name}_render_ms"] = render
        if not name.endswith("shadows"):
            results[f"{name}_ms_per_decision"] = args.chunk * step + render
            results[f"{name}_ms_per_step"] = step + render / args.chunk
    results["reset_ms"] = cases["state"].reset_ms(args.rounds)
    results["load_average_1m_end"] = load_average()
    for case in cases.values():
        case.env.close()
    emit(results)
    return results


if __name__ == "__main__":
    main()
