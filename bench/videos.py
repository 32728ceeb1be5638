"""What filming held-out episodes costs next to the evaluation it follows.

    python bench/videos.py                                   # the default BC policy, 100 layouts, 2 videos at 256 px
    python bench/videos.py --checkpoint DIR --layouts 3 --size 32   # a smoke run

One process, one thread (as a rollout actor runs), one RolloutActor built as a run builds its actors, under the
checkpoint's run config (learner.replay.run_config: the BC report's env rules for a BC checkpoint):
  - eval_seconds: actor.evaluate() on the first --layouts held-out layouts (a run deals these out over its actors);
  - record_seconds: actor.record_episodes() of the --episodes a run would film (common.recording.select_episodes:
    first success, first failure), in the batches evaluate() ran them in, at --size px;
  - write_seconds: captioning and encoding those recordings as MP4s (common.recording.save_evaluation_videos);
  - film_over_eval: (record_seconds + write_seconds) / eval_seconds.
recorded_outcomes_match is whether every filmed episode ended as the evaluation says it did (it must).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import emit, load_average, put_repo_on_path, ratio  # noqa: E402

put_repo_on_path()

from actors.rollout_actor import RolloutActor  # noqa: E402
from common.config import RunConfig  # noqa: E402
from common.recording import VIDEO_SIZE, recording_calls, save_evaluation_videos, select_episodes  # noqa: E402
from common.suites import make_suite  # noqa: E402
from learner.pretrain import ensure_bc_checkpoint  # noqa: E402
from learner.replay import run_config  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", help="policy directory (default: the cached BC checkpoint of the default config)")
    parser.add_argument("--layouts", type=int, default=100, help="held-out layouts evaluated (default 100)")
    parser.add_argument("--episodes", type=int, default=2, help="episodes filmed (default 2, as eval_videos)")
    parser.add_argument("--size", type=int, default=VIDEO_SIZE, help=f"frame side in pixels (default {VIDEO_SIZE})")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    checkpoint = Path(args.checkpoint) if args.checkpoint else ensure_bc_checkpoint(RunConfig())
    config = run_config(checkpoint, None, None)
    actor = RolloutActor(config, 0, checkpoint)
    held_out = make_suite(config.env).held_out(args.layouts)

    start = time.perf_counter()
    _, successes = actor.evaluate(None, held_out)
    eval_seconds = time.perf_counter() - start

    chosen = select_episodes([config.env.task] * len(held_out), successes, args.episodes)
    ((_, share, positions),) = recording_calls({0: range(len(held_out))}, chosen)  # one actor evaluated them all
    start = time.perf_counter()
    recordings = actor.record_episodes(None, [held_out[i] for i in share], args.size, positions)
    record_seconds = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as run_dir:
        start = time.perf_counter()
        save_evaluation_videos(run_dir, 0, recordings)
        write_seconds = time.perf_counter() - start
    actor.close()

    results = {
        "eval_layouts": len(held_out),
        "eval_success_rate": float(successes.mean()),
        "eval_seconds": eval_seconds,
        "episodes_filmed": len(recordings),
        "frames_filmed": sum(len(recording.frames) for recording in recordings),
        "frame_size": args.size,
        "record_seconds": record_seconds,
        "write_seconds": write_seconds,
        "film_over_eval": ratio(record_seconds + write_seconds, eval_seconds),
        "recorded_outcomes_match": [r.success for r in recordings] == [bool(successes[i]) for i in chosen],
        "load_average_1m_end": load_average(),
    }
    emit(results)
    return results


if __name__ == "__main__":
    main()
