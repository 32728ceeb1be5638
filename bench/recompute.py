"""The learner's recompute cost against one sampling pass over the same chains, as K, H and the batch grow.

    python bench/recompute.py                   # the default MLP policy, one thread, plot in docs/recompute_cost.png
    python bench/recompute.py --repeats 1 --batches 50 --steps 2 --horizons 4 --plot ""   # a smoke run

For each setting (denoising steps K, chunk H, decisions B; the others at the default policy's K=4, H=4 and a
B of 500) the default MLP flow policy (random weights: the cost does not depend on them):
  - sample: `common.flow.sample_chain` for B observations, what the actors do per decision (no grad);
  - recompute: `common.flow.chain_log_prob` of those chains, the learner's old log-probs (no grad);
  - train: the same with grad, forward and backward, one epoch of the update's log-prob work.
Seconds are the median of --repeats after one untimed pass. recompute_over_sample and train_over_sample compare
each with the sampling pass of the same chains. All of it in one thread, so the ratios are the work's, not the
scheduler's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.report import REPO_ROOT, emit  # noqa: E402
from common.config import PolicyConfig  # noqa: E402
from common.flow import chain_log_prob, sample_chain  # noqa: E402
from common.observation import Observation  # noqa: E402
from common.policy import build_policy  # noqa: E402

DEFAULT_K, DEFAULT_H, DEFAULT_B = 4, 4, 500


def median_seconds(work: Callable[[], object], repeats: int) -> float:
    work()  # untimed: first touches of the allocator and the kernels
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        work()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def measure(num_steps: int, chunk_size: int, batch: int, repeats: int) -> dict[str, float]:
    torch.manual_seed(0)
    policy = build_policy(PolicyConfig(num_steps=num_steps, chunk_size=chunk_size, init_noise_std=1.0)).eval()
    obs = Observation(state=torch.randn(batch, policy.config.obs_dim))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        features = policy.encode(obs)
        chains = sample_chain(policy, features, batch, generator=generator).chain

    def sample() -> None:
        with torch.no_grad():
            sample_chain(policy, features, batch, generator=generator)

    def recompute() -> None:
        with torch.no_grad():
            chain_log_prob(policy, features, chains)

    def train() -> None:
        policy.zero_grad(set_to_none=True)
        chain_log_prob(policy, features, chains).log_prob.mean().backward()

    figures = {name: median_seconds(work, repeats) for name, work in (("sample", sample), ("recompute", recompute), ("train", train))}
    return {
        "sample_seconds": figures["sample"],
        "recompute_seconds": figures["recompute"],
        "train_seconds": figures["train"],
        "recompute_over_sample": figures["recompute"] / figures["sample"],
        "train_over_sample": figures["train"] / figures["sample"],
    }


def plot(results: dict, sweeps: dict[str, list[int]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sweeps), figsize=(4 * len(sweeps), 3.4), sharey=True)
    for ax, (name, values) in zip(axes, sweeps.items()):
        cases = [results["cases"][case_name(name, v)] for v in values]
        for key, label in (("recompute_over_sample", "recompute (no grad)"), ("train_over_sample", "forward + backward")):
            ax.plot(values, [c[key] for c in cases], marker="o", label=label)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(values, [str(v) for v in values])
        ax.set_xlabel(name)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("seconds / one sampling pass")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"learner's log-prob work over the same chains, MLP policy (defaults K={DEFAULT_K}, H={DEFAULT_H}, B={DEFAULT_B})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def setting(name: str, value: int) -> tuple[int, int, int]:
    """(K, H, B) with `name` set to `value` and the others at their defaults."""
    return tuple(value if name == n else default for n, default in (("K", DEFAULT_K), ("H", DEFAULT_H), ("B", DEFAULT_B)))


def case_name(name: str, value: int) -> str:
    k, h, b = setting(name, value)
    return f"K{k}_H{h}_B{b}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default="2,4,8,16", help="denoising steps K, comma-separated")
    parser.add_argument("--horizons", default="4,8,16", help="chunk sizes H, comma-separated")
    parser.add_argument("--batches", default="100,500,2000", help="decisions B, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--plot", default=str(REPO_ROOT / "docs" / "recompute_cost.png"), help='PNG path ("": none)')
    args = parser.parse_args(argv)
    sweeps = {name: [int(v) for v in values.split(",")] for name, values in (("K", args.steps), ("H", args.horizons), ("B", args.batches))}
    torch.set_num_threads(1)
    results: dict = {"bench": "recompute", "threads": 1, "cases": {}}
    for name, values in sweeps.items():
        for value in values:
            case = case_name(name, value)
            if case not in results["cases"]:
                results["cases"][case] = measure(*setting(name, value), args.repeats)
    if args.plot:
        plot(results, sweeps, Path(args.plot))
        results["plot"] = args.plot
    emit(results)
    return results


if __name__ == "__main__":
    main()
