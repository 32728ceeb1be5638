"""Behaviour-cloning pre-training of the flow policy from a suite's scripted demonstrations (Metaworld's experts).

    python -m learner.pretrain --out checkpoints/bc            # defaults from common.config.PretrainConfig
    python -m learner.pretrain --set pretrain.num_demos=7 --out /tmp/bc7

RL fine-tuning starts from a pre-trained policy, and no weights are downloaded at run time, so the project
makes its own: the scripted expert is rolled out (with action noise) on `pretrain.num_demos` layouts of
`env.demo_benchmark_seed`, the velocity field is trained with the conditional flow-matching loss, and the
checkpoint (safetensors + config + normalisation statistics as buffers) is evaluated deterministically
on held-out layouts. The starting policy is deliberately weak, to leave room for RL: by default
(`pretrain.num_demos: null`) the number of demonstrations is chosen per task so that held-out success lands
in [pretrain.target_success_min, target_success_max] (ensure_bc_checkpoint; every candidate is cached).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from common.config import ConfigError
from common.config_loading import load_config
from common.console import log
from common.policy import write_directory_atomically
from learner.bc.starting_checkpoint import ensure_bc_checkpoint
from learner.bc.training import REPORT_FILE, pretrain


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML run config (its env/policy/pretrain sections are used)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="override a config field")
    parser.add_argument("--out", required=True, help="checkpoint directory to write (must not exist yet)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.set)
    except ConfigError as exc:
        log.error(f"config error: {exc}")
        return 2
    out = Path(args.out)
    if not args.out.strip() or out.exists():
        log.error(f"error: --out {args.out!r} {'already exists' if args.out.strip() else 'is empty'}: name a new directory")
        return 2
    if config.pretrain.num_demos is None:  # the per-task search, through the cache, then a copy of the chosen checkpoint
        chosen = ensure_bc_checkpoint(config)
        write_directory_atomically(out, lambda tmp: shutil.copytree(chosen, tmp, dirs_exist_ok=True))
        report = json.loads((out / REPORT_FILE).read_text())
    else:
        report = pretrain(config, out)
    log.info(json.dumps({k: v for k, v in report.items() if k != "config"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
