"""Loading a policy from its checkpoint, as every rollout actor and the learner do at start: built without
initialising its weights (FlowPolicy.from_pretrained) against built with them and then overwritten (how a checkpoint
was loaded before), side by side in one process, at a recipe's size with random weights. Both must give the same
tensors, the buffers no file holds included. Then the time to read the stand-in as the recipe's lerobot checkpoint
(policy.<section>.lerobot_checkpoint, as a run starting from one does), built the same way, and the time to verify
the checkpoint's checksums by hashing its files against taking the digests a run's driver hands its processes.

    python bench/policy_load.py --recipe configs/pi0_pick.yaml      # full-size pi0: 4B parameters, 16 GB in float32
    python bench/policy_load.py --recipe configs/smolvla_pick.yaml  # smolvla_base's shapes
    python bench/policy_load.py --size tiny                         # seconds (tests/integration/test_bench.py)

The checkpoint is written as bench/smolvla_gpu.py writes it (an offline stand-in for the recipe's lerobot checkpoint,
loaded strictly and saved as the project's checkpoint). The file is read once before timing, so both paths find it in
the page cache. Prints JSON, then `name: value` lines.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import emit  # noqa: E402
from bench.smolvla_gpu import RECIPE, write_inputs  # noqa: E402
from common.file_digests import forget_digests  # noqa: E402
from common.policy import FlowPolicy, build_policy  # noqa: E402
from common.policy.base import WEIGHTS_FILE, policy_class, read_policy_config  # noqa: E402
from common.storage import read_safetensors, verify_checksums  # noqa: E402


def initialised_then_loaded(checkpoint: Path) -> FlowPolicy:
    """The checkpoint loaded into a policy built with its random initialisation (as from_pretrained did before)."""
    config = read_policy_config(checkpoint)
    policy = policy_class(config.type)(config)
    policy.load_state_dict(read_safetensors(checkpoint / WEIGHTS_FILE))
    return policy.eval()


def fingerprint(policy: FlowPolicy) -> str:
    """sha256 over every tensor's name and bytes: parameters, and buffers whether the file holds them or not."""
    digest = hashlib.sha256()
    tensors = {**dict(policy.named_parameters()), **dict(policy.named_buffers())}
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def timed(load, checkpoint: Path) -> tuple[float, str]:
    start = time.perf_counter()
    policy = load(checkpoint)
    return time.perf_counter() - start, fingerprint(policy)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("full", "tiny"), default="full")
    parser.add_argument("--recipe", type=Path, default=RECIPE, help="the run config whose policy is loaded")
    parser.add_argument("--repeats", type=int, default=1, help="loads by each path, alternating")
    parser.add_argument("--work-dir", default=None, help="where the stand-in and the checkpoint are written (a temporary dir)")
    args = parser.parse_args(argv)

    # stdout carries the figures only: what lerobot prints goes to stderr.
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp, contextlib.redirect_stdout(sys.stderr):
        start = time.perf_counter()
        config, checkpoint, counts = write_inputs(Path(tmp), args.size, [], args.recipe)
        results: dict[str, Any] = {"policy_type": config.policy.type, "parameters": counts["parameters"], "torch": torch.__version__}
        results["write_checkpoint_seconds"] = time.perf_counter() - start
        read_safetensors(checkpoint / WEIGHTS_FILE)  # into the page cache
        seconds: dict[str, list[float]] = {"initialised": [], "skipped": []}
        digests = set()
        for _ in range(args.repeats):
            for path, load in (("initialised", initialised_then_loaded), ("skipped", FlowPolicy.from_pretrained)):
                print(f"[policy_load] {path} ...", file=sys.stderr, flush=True)
                forget_digests()  # each path verifies the checksums, as a process loading the file the first time does
                took, digest = timed(load, checkpoint)
                seconds[path].append(took)
                digests.add(digest)
        for kept in (False, True):  # a process that hashes the files, then one that holds their digests (the driver's)
            if not kept:
                forget_digests()
            start = time.perf_counter()
            verify_checksums(checkpoint)
            results[f"verify_checksums_{'digests_kept' if kept else 'hashed'}_seconds"] = time.perf_counter() - start
        print("[policy_load] the stand-in as a lerobot checkpoint ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        build_policy(config.policy)  # reads policy.<section>.lerobot_checkpoint strictly
        results["lerobot_checkpoint_load_seconds"] = time.perf_counter() - start
    results.update({f"load_{path}_init_seconds": min(times) for path, times in seconds.items()})
    results["speedup"] = results["load_initialised_init_seconds"] / results["load_skipped_init_seconds"]
    results["same_tensors"] = len(digests) == 1
    emit(results)
    return 0 if results["same_tensors"] else 1


if __name__ == "__main__":
    sys.exit(main())
