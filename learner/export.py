"""The command line: `python -m learner.export CHECKPOINT --out DIR`: a fine-tuned VLA policy as a lerobot checkpoint.

CHECKPOINT is a policy directory written by save_pretrained (a BC checkpoint, or a run's checkpoints/iter_NNNNNN), or
a run directory or its checkpoints/ directory (then the run's latest checkpoint, as learner.replay resolves it). It is
loaded strictly (FlowPolicy.from_pretrained: checksums, every tensor), and its backend writes what lerobot's own
loaders read (FlowPolicy.to_lerobot): lerobot's policy config and weights, and its processor pipelines carrying the
project's normalisation. What the backend keeps to itself (the VLAs' noise head and critic) is left out. DIR is
written whole or not at all (write_directory_atomically, with a checksums.json); an existing DIR is replaced only
with --overwrite. The files lerobot reads by name and the export does not hold (SmolVLA's backbone config, processor
and tokenizer; pi0's tokenizer) are named by their hub id (--hub-id, or the one the checkpoint records), so that the
directory loads on another machine; without one, by their directory on this machine, with a note saying so.

Nothing here depends on the backend: a backend exports when its record in common.policy.registry.BACKENDS names a
lerobot type (SmolVLA's "smolvla", pi0's "pi0" and "pi05") and it implements to_lerobot; the MLP has no lerobot
counterpart and is refused. Bad input is one line on stderr and exit status 2, before anything is written.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from common.console import log
from common.metrics import MetricsLog
from common.policy import CHECKSUMS_FILE, OBS_CLIP, FlowPolicy, read_policy_config, write_directory_atomically
from common.policy.registry import BACKENDS
from common.policy.torchvision_shim import plain_import_advice, plain_import_fails
from common.validation import require_hub_id
from learner.command_shell import input_checks, run_command
from learner.files.run_dir import policy_directory


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m learner.export", description="Write a fine-tuned VLA policy as a lerobot checkpoint.")
    parser.add_argument("checkpoint", help="policy directory, run directory (its latest checkpoint), or a run's checkpoints/ directory")
    parser.add_argument("--out", required=True, help="directory to write the lerobot checkpoint to")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.add_argument(
        "--hub-id",
        help="the hub id (owner/name) of the backbone (SmolVLA) or tokenizer (pi0) files the policy read from a local directory: "
        "the export names them by it, so that it loads wherever the hub or its cache holds them (default: the id the "
        "checkpoint records, e.g. from its lerobot checkpoint)",
    )
    return parser.parse_args(argv)


def check_out(out: Path, checkpoint: Path, overwrite: bool) -> None:
    """--out may be replaced only when asked, only if it is a directory, and never if it holds the checkpoint."""
    if not out.exists():
        return
    if not overwrite:
        raise ValueError(f"--out {out} exists: pass --overwrite to replace it, or pick another directory")
    if not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    if out.resolve() in (checkpoint.resolve(), *checkpoint.resolve().parents):
        raise ValueError(f"--out {out} holds the checkpoint {checkpoint} being exported: pick another directory")


def load(checkpoint: Path) -> FlowPolicy:
    """The checkpoint's policy, loaded strictly, after checking that its backend has a lerobot counterpart."""
    config = read_policy_config(checkpoint)  # verifies the checksums
    if BACKENDS[config.type].lerobot_type is None:
        raise ValueError(
            f"{checkpoint} holds a policy.type {config.type!r} policy, which has no lerobot counterpart: "
            "there is nothing to export to lerobot (the VLA backends export)"
        )
    return FlowPolicy.from_pretrained(checkpoint)


def beyond_clip_note(checkpoint: Path, last: int = 10) -> str | None:
    """For a checkpoint of a run (RUN/checkpoints/iter_NNNNNN) whose metrics.jsonl logs rollout/state_beyond_clip: how
    often the run's last `last` iterations up to it met states the policy clips and lerobot's normaliser does not."""
    run = checkpoint.parent.parent
    if checkpoint.parent.name != "checkpoints" or not checkpoint.name.startswith("iter_") or not (run / "metrics.jsonl").is_file():
        return None
    iteration = int(checkpoint.name.removeprefix("iter_"))
    rows = [row for row in MetricsLog(run / "metrics.jsonl").read() if row["iteration"] <= iteration and "rollout/state_beyond_clip" in row]
    if not rows:
        return None
    rows = rows[-last:]
    share = sum(row["rollout/state_beyond_clip"] for row in rows) / len(rows)
    return (
        f"note: lerobot's normaliser does not clip the state as the policy does (at +-{OBS_CLIP:g} std of its mean): in "
        f"iterations {rows[0]['iteration']}-{rows[-1]['iteration']} of the run, {100 * share:.1f}% of the decisions met "
        "a state beyond it, where lerobot's actions differ from the policy's"
    )


def how_to_load(out: Path, policy: FlowPolicy) -> str:
    """How lerobot loads the export and samples the policy the project evaluated: lerobot draws each chain's start from
    N(0, I) unless it is given one, as the project's evaluation does only with policy.eval_init_noise_std 1.0."""
    lines = [
        "load it in lerobot:",
        "  from lerobot.policies.factory import get_policy_class, make_pre_post_processors",
        f'  policy = get_policy_class("{policy.lerobot_type}").from_pretrained("{out}")',
        f'  preprocessor, postprocessor = make_pre_post_processors(policy.config, pretrained_path="{out}")',
    ]
    start = policy.config.eval_init_noise_std
    if start == 1.0:
        lines += [
            "  actions = postprocessor(policy.predict_action_chunk(preprocessor(observation)))",
            "  # lerobot draws each chain's start from N(0, I), as the project evaluated it: lerobot-eval runs the same policy",
        ]
        return "\n".join(lines)
    lines += [
        f"  # the project evaluated it from a_0 = {'0' if start == 0 else f'N(0, {start:g}^2)'}; lerobot draws N(0, I) unless "
        "given the start:",
        "  shape = (batch_size, policy.config.chunk_size, policy.config.max_action_dim)",
        f"  noise = {'torch.zeros(shape)' if start == 0 else f'{start:g} * torch.randn(shape)'}",
        "  actions = postprocessor(policy.predict_action_chunk(preprocessor(observation), noise=noise))",
        "note: lerobot-eval passes no start, so it scores another policy than the project evaluated; a policy trained and "
        "evaluated from lerobot's start (policy.init_noise_std and eval_init_noise_std 1.0) is the same on both (docs/lerobot.md)",
    ]
    return "\n".join(lines)


def export(args: argparse.Namespace) -> int:
    out = Path(args.out)
    groups: dict[str, list[str]] = {}
    with contextlib.redirect_stdout(sys.stderr):  # lerobot's progress messages; stdout carries the summary alone
        with input_checks():
            if args.hub_id is not None:
                require_hub_id(args.hub_id, "--hub-id")
            checkpoint = policy_directory(Path(args.checkpoint))
            check_out(out, checkpoint, args.overwrite)
            policy = load(checkpoint)
            hub_id = args.hub_id or policy.lerobot_hub_id()
        write_directory_atomically(out, lambda tmp: groups.update(policy.to_lerobot(tmp, hub_id)))
    log.info(f"wrote a lerobot {policy.lerobot_type} checkpoint of {checkpoint} to {out}:")
    for what, names in {**groups, "sha256 of every file": [CHECKSUMS_FILE]}.items():
        log.info(f"  {', '.join(names)}: {what}")
    log.info(how_to_load(out.resolve(), policy))
    if hub_id is None:
        log.info(
            f"note: the export names {policy.lerobot_files()} (this machine's) for the files it does not hold, so it "
            "loads only where that directory exists; give their hub id with --hub-id to load it anywhere"
        )
    clipped = beyond_clip_note(checkpoint)
    if clipped:
        log.info(clipped)
    if plain_import_fails():
        log.info(f"note: {plain_import_advice()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_command("python -m learner.export", lambda: export(args))


if __name__ == "__main__":
    sys.exit(main())
