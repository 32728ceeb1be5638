"""The activations a pi0 / pi0.5 learner keeps for the backward pass of one decision, at the recipe's widths, prefix
length and chunk, counted on the CPU: the learner's memory beyond its weights and optimiser, which sets how many
decisions a micro-batch can hold on a GPU.

    python bench/activation_bytes.py                                 # configs/pi0_pick.yaml (lerobot 0.6)
    python bench/activation_bytes.py --recipe configs/pi05_pick.yaml

Those models do not fit this kind of machine whole (4 B parameters), and every Gemma layer keeps the same activations:
so the recipe's model is built twice, both Gemmas cut to 1 and then 2 layers (everything else at its real size: SigLIP,
the 257k vocabulary, the widths and heads), and the bytes of a model of the real depth are the 1-layer count plus one
layer's (the 2-layer count minus the 1-layer one) for every further layer. pi0.5's prompt is spelled by the offline
character tokenizer, a token per character of its state bins, so its prefix is longer than PaliGemma's tokenizer makes
it (bench/smolvla_gpu.py's PI05_CHARACTER_PROMPT_TOKENS) and its counts err on the large side. Random weights: shapes alone set the count
(bench/smolvla_gpu.py's SavedForBackward: the most bytes autograd holds at once for the backward pass, each storage
once, parameters left out), so a CPU run reads what a GPU holds beyond its kernels' own workspace.

For each learner path (`float32_steps`: float32, step by step, the pi0 recipes' learner; `float32_recompute`: the same
with each step's forward run again in the backward pass, learner.speed.recompute_steps; `bfloat16_one_pass`: bfloat16
autocast, the K steps in one pass, SmolVLA's recipe's), with transformers' eager attention as lerobot runs it and with
the fused attention (`_fused`: learner.speed.fused_attention): `<path>_layers1_bytes`, `<path>_layers2_bytes`,
`<path>_gib_per_decision` at the model's depth, `<path>_gib_per_micro_batch` at the recipe's micro-batch
(algorithm.minibatch_size / algorithm.grad_accum decisions), `<path>_fused_over_eager`, and the fused path's largest
log-prob difference from the eager one on the same chains (`<path>_fused_log_prob_max_diff`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.report import emit, ratio  # noqa: E402
from bench.smolvla_gpu import PI05_CHARACTER_PROMPT_TOKENS, SavedForBackward  # noqa: E402
from common.config import RunConfig  # noqa: E402
from common.config_loading import load_config  # noqa: E402
from common.flow import chain_log_prob, sample_chain  # noqa: E402
from common.observation import Observation  # noqa: E402

GIB = 2**30
# path -> (bfloat16 autocast, steps in one pass, steps recomputed in the backward pass)
PATHS = {"float32_steps": (False, False, False), "float32_recompute": (False, False, True), "bfloat16_one_pass": (True, True, False)}


@contextlib.contextmanager
def gemma_depth(module: Any, depth: int) -> Iterator[list[int]]:
    """While open, lerobot's pi0 / pi0.5 `module` builds both Gemmas with `depth` layers, whatever their variant (the
    tiny ones included: every variant is a GemmaConfig of that module); the list it yields receives their real depths."""
    from common.policy.pi0.stand_ins import swapped_attributes

    real = module.GemmaConfig
    depths: list[int] = []

    def cut(**fields: Any) -> Any:
        depths.append(fields["depth"])
        return real(**{**fields, "depth": depth})

    with swapped_attributes(module, {"GemmaConfig": cut}):
        yield depths


def observations(policy: Any, batch: int) -> Observation:
    """Random frames of every camera at the recipe's size, random states, the recipe's instruction length."""
    generator = torch.Generator().manual_seed(0)
    size, cameras = policy.config.image_size, len(policy.config.cameras)
    tokens, mask = policy.tokenize(["pick up the block and place it at the goal"] * batch)
    return Observation(
        state=torch.randn(batch, policy.config.obs_dim, generator=generator),
        images=torch.randint(0, 256, (batch, cameras, size, size, 3), dtype=torch.uint8, generator=generator),
        tokens=torch.from_numpy(tokens),
        token_mask=torch.from_numpy(mask),
    )


def kept_bytes(config: RunConfig, depth: int, decisions: int) -> tuple[dict[str, Any], int]:
    """The recipe's policy at `depth` layers -> ({path: bytes kept, path_fused_log_prob_max_diff: ...}, real depth)."""
    from common.policy.pi0.model import LEROBOT_CLASSES, PiFlowPolicy

    policy_config = dataclasses.replace(
        config.policy, pi0=dataclasses.replace(config.policy.pi0, lerobot_checkpoint="", tokenizer_path="", reinit_state_proj=False)
    )
    torch.manual_seed(0)
    with gemma_depth(LEROBOT_CLASSES[policy_config.type][2], depth) as depths:
        policy = PiFlowPolicy(policy_config).eval()
    obs = observations(policy, decisions)
    with torch.no_grad():
        features = policy.encode(obs)
        chain = sample_chain(policy, features, decisions, generator=torch.Generator().manual_seed(1)).chain
    print(f"[{depth} layer(s)] prefix of {features.prefix_pad_mask.shape[1]} tokens", file=sys.stderr, flush=True)
    results: dict[str, Any] = {"prefix_tokens": features.prefix_pad_mask.shape[1]}
    for path, (bfloat16, one_pass, recompute) in PATHS.items():
        log_probs = {}
        for fused in (False, True):
            policy.fuse_attention(fused)
            policy.zero_grad(set_to_none=True)
            autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bfloat16, cache_enabled=False)
            saved = SavedForBackward()
            with saved, autocast:
                log_prob = chain_log_prob(policy, features, chain, recompute, one_pass).log_prob
            log_prob.sum().backward()
            name = f"{path}_fused" if fused else path
            results[name], log_probs[fused] = saved.peak_bytes, log_prob.detach()
            print(f"[{depth} layer(s)] {name}: {saved.peak_bytes / GIB:.3f} GiB kept", file=sys.stderr, flush=True)
        results[f"{path}_fused_log_prob_max_diff"] = (log_probs[True] - log_probs[False]).abs().max().item()
    return results, max(depths)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="configs/pi0_pick.yaml", help="a pi0 or pi0.5 run config")
    parser.add_argument("--decisions", type=int, default=2, help="decisions scored at once (the counts are per decision)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="run-config override (as learner.main)")
    args = parser.parse_args(argv)
    if args.decisions < 1:
        parser.error(f"--decisions {args.decisions}: at least 1")
    config = load_config(args.recipe, args.set)
    if config.policy.type == "pi05":  # the offline tokenizer spells each state bin a character a token: a longer prompt
        config = load_config(args.recipe, [f"policy.pi0.tokenizer_max_length={PI05_CHARACTER_PROMPT_TOKENS}", *args.set])
    if config.policy.type not in ("pi0", "pi05"):
        parser.error(f"{args.recipe} is a {config.policy.type} recipe: this bench cuts pi0's and pi0.5's Gemmas (SmolVLA's full size "
                     "fits a CPU: bench/smolvla_gpu.py --size full reads its update's saved_for_backward_peak_bytes)")  # fmt: skip
    (one, depth), (two, _) = kept_bytes(config, 1, args.decisions), kept_bytes(config, 2, args.decisions)
    micro_batch = config.algorithm.minibatch_size // config.algorithm.grad_accum
    results: dict[str, Any] = {
        "recipe": args.recipe, "policy": config.policy.type, "depth": depth, "decisions": args.decisions,
        "prefix_tokens": one["prefix_tokens"], "micro_batch_decisions": micro_batch,
    }  # fmt: skip
    for path in PATHS:
        for name in (path, f"{path}_fused"):
            per_layer = two[name] - one[name]
            whole = one[name] + (depth - 1) * per_layer
            results[f"{name}_layers1_bytes"], results[f"{name}_layers2_bytes"] = one[name], two[name]
            results[f"{name}_gib_per_decision"] = whole / args.decisions / GIB
            results[f"{name}_gib_per_micro_batch"] = whole / args.decisions * micro_batch / GIB
        results[f"{path}_fused_over_eager"] = ratio(results[f"{path}_fused_gib_per_decision"], results[f"{path}_gib_per_decision"])
        results[f"{path}_fused_log_prob_max_diff"] = max(one[f"{path}_fused_log_prob_max_diff"], two[f"{path}_fused_log_prob_max_diff"])
    emit(results)


if __name__ == "__main__":
    main()
