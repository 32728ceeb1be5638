"""Bytes of the rollout record an iteration sends from the rollout actors to the learner, for a recipe: one actor's
real rollout of iteration 0 (its envs, frames, instruction tokens and chains at the recipe's shapes), weighed field by
field and as Ray serialises it (pickle protocol 5, arrays out of band), then times the recipe's actors.

    python bench/record_bytes.py                                  # the embedded default (the MLP)
    python bench/record_bytes.py --config configs/smolvla_pick.yaml
    python bench/record_bytes.py --config configs/pi0_pick.yaml   # lerobot 0.6

The weights are random: what they change is only how many episodes end early (each end adds a bootstrap observation
and a row of episode statistics). A VLA recipe's model is the tiny stand-in of
bench/smolvla_gpu.py --size tiny, with the recipe's frames, cameras, chunk, denoising steps, tokens, envs, decisions and
episode length kept, so the record has the recipe's shapes; only the model is small. Prints JSON, then `name: value`
lines.
"""

from __future__ import annotations

import argparse
import functools
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from actors.rollout_actor import RolloutActor  # noqa: E402
from bench.report import emit, record_arrays  # noqa: E402
from bench.smolvla_gpu import write_inputs  # noqa: E402
from common.config import RunConfig  # noqa: E402
from common.config_loading import load_config  # noqa: E402
from common.policy import build_policy  # noqa: E402
from common.storage import write_directory_atomically  # noqa: E402

# What --size tiny shrinks beyond the model, set back to the recipe's own values.
RECIPE_SHAPES = ("policy.image_size", "policy.chunk_size", "policy.num_steps", "actors.envs_per_actor", "actors.decisions_per_rollout",
                 "env.max_episode_steps")  # fmt: skip


def serialized_bytes(record: Any) -> int:
    """The record's size as Ray's object store holds it: the pickle stream plus its out-of-band buffers."""
    buffers: list[pickle.PickleBuffer] = []
    stream = pickle.dumps(record, protocol=5, buffer_callback=buffers.append)
    return len(stream) + sum(buffer.raw().nbytes for buffer in buffers)


def recipe_config(config_path: str | None, sets: list[str], work: Path) -> tuple[RunConfig, Path]:
    """The recipe's run config and a checkpoint of random weights its actors load."""
    recipe = load_config(config_path, sets)
    if recipe.policy.vla_section() is None:  # the MLP
        torch.manual_seed(0)
        return recipe, write_directory_atomically(work / "checkpoint", build_policy(recipe.policy).save_pretrained)
    shapes = [f"{name}={functools.reduce(getattr, name.split('.'), recipe)}" for name in RECIPE_SHAPES]
    config, checkpoint, _ = write_inputs(work, "tiny", [*shapes, *sets], Path(config_path))
    return config, checkpoint


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="a recipe (default: the embedded default)")
    parser.add_argument("--set", action="append", default=[], help="a dotted override, as learner.main takes")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        config, checkpoint = recipe_config(args.config, args.set, Path(work))
        record = RolloutActor(config, 0, checkpoint).sample(None, iteration=0)
    fields = {name: int(array.nbytes) for name, array in record_arrays(record).items()}
    actors = config.actors.num_actors
    results = {
        "recipe": args.config or "default",
        "decisions_per_actor": record.num_decisions * record.num_envs,
        "record_bytes_per_actor": sum(fields.values()),
        "serialized_bytes_per_actor": serialized_bytes(record),
        "serialized_bytes_per_iteration": actors * serialized_bytes(record),
        "field_bytes_per_actor": fields,
    }
    emit(results)
    return results


if __name__ == "__main__":
    main()
