"""Metrics shared by the driver, wandb and the Ray dashboard: one set of keys, one console format.

Keys are namespaced like CleanRL's (`rollout/`, `losses/`, `ppo/`, `logprob/`, `eval/`, `time/`).
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import numpy as np

from common.storage import RunFileWriteError
from common.trajectory import RolloutBatch


def rollout_metrics(batch: RolloutBatch, learner_version: int) -> dict[str, float]:
    """Statistics of one iteration's rollouts (several actors' batches concatenated); in a multi-task run also each
    task's episodes, success rates and first episodes' mean return (rollout/task/<task>/...).
    rollout/first_episode_success_rate is the sampling policy's success on the training layouts (each env's first
    episode of the rollout, RolloutBatch.episode_first);
    rollout/success_rate, over every episode that ended, favours the quick successes an env repeats in one rollout."""
    finished = len(batch.episode_successes)
    firsts = batch.episode_successes[batch.episode_first]
    metrics = {
        "rollout/env_steps": float(batch.env_steps),
        "rollout/decisions": float(batch.num_decisions * batch.num_envs),
        "faults/dropped_decisions": float((~batch.valid).sum()),  # of episodes an env ended with NaN/Inf output
        "rollout/episodes": float(finished),
        "rollout/success_rate": float(batch.episode_successes.mean()) if finished else math.nan,
        "rollout/first_episode_success_rate": float(firsts.mean()) if len(firsts) else math.nan,
        "rollout/episode_return": float(batch.episode_returns.mean()) if finished else math.nan,
        "rollout/episode_length": float(batch.episode_lengths.mean()) if finished else math.nan,
        "rollout/reward_per_decision": float(batch.rewards.mean()),
        "rollout/behaviour_logprob_per_element": float(batch.log_probs_per_element.mean()),
        "rollout/weight_version": float(batch.weight_version),
        "rollout/weight_version_lag": float(learner_version - batch.weight_version),
        "time/sample_seconds": batch.sample_seconds,
        "time/actors_policy_cpu_seconds": batch.policy_cpu_seconds,
        "time/actors_env_cpu_seconds": batch.env_cpu_seconds,
    }
    tasks = np.array(batch.episode_tasks)
    names = sorted(set(batch.episode_tasks))
    for task in names if len(names) > 1 else ():
        metrics[task_key(task, "episodes", "rollout")] = float((tasks == task).sum())
        metrics[task_key(task, "success_rate", "rollout")] = float(batch.episode_successes[tasks == task].mean())
        first_of_task = batch.episode_successes[(tasks == task) & batch.episode_first]
        metrics[task_key(task, "first_episode_success_rate", "rollout")] = float(first_of_task.mean()) if len(first_of_task) else math.nan
        metrics[task_key(task, "first_episodes", "rollout")] = float(len(first_of_task))
        first_returns = batch.episode_returns[(tasks == task) & batch.episode_first]
        metrics[task_key(task, "first_episode_return", "rollout")] = float(first_returns.mean()) if len(first_returns) else math.nan
    return metrics


CONSOLE_FIELDS = (
    ("it", "iteration", "{:.0f}"),
    ("steps", "rollout/total_env_steps", "{:.0f}"),
    ("succ", "rollout/first_episode_success_rate", "{:.2f}"),
    ("ret", "rollout/episode_return", "{:.2f}"),
    ("eval", "eval/success_rate", "{:.2f}"),
    ("kl", "losses/approx_kl", "{:.2e}"),
    ("clip", "losses/clipfrac", "{:.2f}"),
    ("ratio", None, None),
    ("logp/el", "logprob/per_element", "{:+.3f}"),
    ("gnorm", "losses/actor_grad_norm", "{:.2f}"),
    ("vgnorm", "losses/critic_grad_norm", "{:.2f}"),
    ("sps", "time/env_steps_per_second", "{:.0f}"),
    ("lag", "rollout/weight_version_lag", "{:.0f}"),
)


def console_line(metrics: dict[str, float]) -> str:
    """One line per iteration with the quantities that reveal an exploding run first."""
    parts = []
    for label, key, fmt in CONSOLE_FIELDS:
        if key is None:
            low, high = metrics.get("ppo/ratio_min"), metrics.get("ppo/ratio_max")
            if low is not None:
                parts.append(f"ratio [{low:.3f},{high:.3f}]")
            continue
        value = metrics.get(key)
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            parts.append(f"{label} {fmt.format(value)}")
    return " | ".join(parts)


class MetricsLog:
    """Append-only JSON-lines log of every iteration's metrics (survives crashes line by line)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._drop_torn_tail()

    def _drop_torn_tail(self) -> None:
        """A crash mid-write leaves a last line without its newline; cut it, so the next row starts a fresh line."""
        if not self.path.is_file():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            with self.path.open("r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)

    def write(self, metrics: dict[str, float]) -> None:
        """Append one row; RunFileWriteError (one line, naming the file) when the disk refuses it."""
        line = json.dumps({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in metrics.items()}) + "\n"
        try:
            with self.path.open("a") as f:
                f.write(line)
        except OSError as exc:
            with contextlib.suppress(OSError):  # a half-written row is cut now (a cut frees space), not left for the next one
                self._drop_torn_tail()
            raise RunFileWriteError.of(self.path, exc) from exc

    def read(self) -> list[dict]:
        """Rows in order; after a resume, the latest row of each iteration wins."""
        if not self.path.is_file():
            return []
        rows: dict[int, dict] = {}
        lines = self.path.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                if number == len(lines):  # torn by a crash mid-write: that iteration is redone on resume
                    break
                raise ValueError(f"{self.path}:{number} is not a JSON line: the metrics log is corrupt") from None
            rows[int(row["iteration"])] = row
        return [rows[k] for k in sorted(rows)]


def plot_learning_curve(rows: list[dict], path: str | Path, title: str, initial_eval: dict | None = None) -> Path:
    """Training and held-out evaluation success against env steps, written as a PNG.
    `initial_eval` (the starting policy's evaluation) is drawn at step 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.array([r.get("rollout/total_env_steps", 0) for r in rows], dtype=float)
    fig, ax = plt.subplots(figsize=(7, 4))
    key = "rollout/first_episode_success_rate"
    train = np.array([np.nan if r.get(key) is None else r[key] for r in rows], dtype=float)
    ax.plot(steps, train, alpha=0.4, label="rollout success, each env's first episode (stochastic, train layouts)")
    points = ([(0.0, initial_eval)] if initial_eval else []) + list(zip(steps, rows))
    evals = [
        (s, r["eval/success_rate"], r["eval/success_low"], r["eval/success_high"])
        for s, r in points
        if r.get("eval/success_rate") is not None
    ]
    if evals:
        e = np.array(evals)
        ax.errorbar(
            e[:, 0],
            e[:, 1],
            yerr=[e[:, 1] - e[:, 2], e[:, 3] - e[:, 1]],
            fmt="o-",
            capsize=3,
            label="held-out success (deterministic, 95% CI)",
        )
    return _save_success_plot(fig, ax, path, title, "success rate")


def task_key(task: str, name: str, section: str = "eval") -> str:
    """The key of a multi-task run's per-task metric, e.g. eval/task/reach-v3/success_rate (held-out evaluation) or
    rollout/task/reach-v3/success_rate (the iteration's training episodes)."""
    return f"{section}/task/{task}/{name}"


def evaluated_tasks(rows: list[dict]) -> list[str]:
    """The tasks that the rows' per-task evaluation keys (task_key) name, in order of first appearance."""
    return list(dict.fromkeys(key.split("/")[2] for row in rows for key in row if key.startswith("eval/task/")))


def tasks_against_start(initial: dict, final: dict) -> dict[str, list[str]]:
    """A multi-task run's tasks by where their final held-out success ends against their initial one's Wilson
    interval: {"above": [...], "inside": [...], "below": [...]}. A task's gain counts only outside the interval the
    initial evaluation left it."""
    placed: dict[str, list[str]] = {"above": [], "inside": [], "below": []}
    for task in evaluated_tasks([final]):
        if task_key(task, "success_low") not in initial:
            continue
        rate = final[task_key(task, "success_rate")]
        low, high = (initial[task_key(task, name)] for name in ("success_low", "success_high"))
        placed["above" if rate > high else "below" if rate < low else "inside"].append(task)
    return placed


def why_inside(initial: dict, inside: list[str], stalled: dict[str, dict], helped: dict[str, int]) -> dict[str, str]:
    """Why each task of `inside` (a multi-task run's tasks whose final held-out success lies inside their initial
    interval) did not leave it, in words: solved at the start, stalled to the end (stalled_tasks at the run's end),
    or moved on its training layouts but not held out; `helped`: the tasks given demonstrations after a stall (task ->
    the first iteration that had them)."""
    reasons = {}
    for task in inside:
        start = initial.get(task_key(task, "success_rate"), math.nan)
        if start >= SOLVED_SUCCESS:
            reasons[task] = f"solved at the start ({start:.2f})"
        elif task in stalled:
            stall = stalled[task]
            spans = [
                f"{stall[name]:.2f} over {'iterations ' if name == 'first' else ''}{'-'.join(map(str, stall[name + '_iterations']))}"
                for name in ("first", "previous", "last")
                if name in stall
            ]
            moved = "moved, then " if "previous" in stall else ""
            reasons[task] = f"{moved}stalled to the end: training-layout success " + ", ".join(spans)
        else:
            reasons[task] = "its training-layout success left its first window, its held-out success not its initial interval"
        if task in helped:
            reasons[task] += f"; demonstrations from iteration {helped[task]} (algorithm.stall_demos)"
    return reasons


def plot_task_curves(rows: list[dict], path: str | Path, title: str, initial_eval: dict | None = None) -> Path | None:
    """Held-out success of each task of a multi-task run (eval/task/<task>/success_rate) against env steps, one line
    per task, as a PNG; None when the rows hold no per-task evaluation."""
    points = ([(0.0, initial_eval)] if initial_eval else []) + [(r.get("rollout/total_env_steps", 0), r) for r in rows]
    tasks = evaluated_tasks([r for _, r in points])
    if not tasks:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for task in tasks:
        curve = [(steps, r[task_key(task, "success_rate")]) for steps, r in points if task_key(task, "success_rate") in r]
        ax.plot(*np.array(curve, dtype=float).T, "o-", markersize=3, label=task)
    return _save_success_plot(fig, ax, path, title, "held-out success (deterministic)")


def _save_success_plot(fig, ax, path: str | Path, title: str, ylabel: str) -> Path:
    """Success-rate axes (0 to 1 against env steps), titled, legend in the corner, written as a PNG."""
    import matplotlib.pyplot as plt

    ax.set_xlabel("env steps")
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def success_interval(successes: np.ndarray, z: float = 1.96) -> tuple[float, float, float]:
    """Success rate with its Wilson 95% interval: (rate, low, high)."""
    return counts_interval(float(np.sum(successes)), len(successes), z)


def counts_interval(successes: float, n: int, z: float = 1.96) -> tuple[float, float, float]:
    """`successes` of `n` trials as a rate with its Wilson 95% interval: (rate, low, high)."""
    if n == 0:
        return float("nan"), float("nan"), float("nan")
    p = successes / n
    denom = 1 + z**2 / n
    centre = (p + z**2 / (2 * n)) / denom
    half = z * np.sqrt(p * (1 - p) / n + z**2 / (4 * n**2)) / denom
    # The interval always holds p and stays in [0, 1]; at p = 0 or 1 rounding puts its bound 1e-16 to either side.
    return p, float(max(0.0, min(centre - half, p))), float(min(1.0, max(centre + half, p)))


def eval_metrics(successes: np.ndarray, layouts: list) -> dict[str, float]:
    """Held-out success with its Wilson 95% interval, overall, per layout group (benchmark seed) and, in a multi-task
    run, per task (eval/task/<task>/...), so that a collapse on one group or task shows even when the overall rate
    holds. successes (L,) bool, layouts (L,)."""

    def interval(prefix: str, values: np.ndarray) -> dict[str, float]:
        rate, low, high = success_interval(values)
        return {
            f"{prefix}success_rate": rate,
            f"{prefix}success_low": low,
            f"{prefix}success_high": high,
            f"{prefix}episodes": float(len(values)),
        }

    result = interval("eval/", successes)
    seeds = np.array([layout.benchmark_seed for layout in layouts])
    for seed in sorted(set(seeds.tolist())):
        result |= interval(f"eval/group_seed{seed}/", successes[seeds == seed])
    tasks = np.array([layout.task for layout in layouts])
    if len(set(tasks.tolist())) > 1:
        for task in dict.fromkeys(tasks.tolist()):
            result |= interval(task_key(task, ""), successes[tasks == task])
    return result


def plot_seed_curves(curves: dict[int, tuple[dict, list[dict]]], path: str | Path, title: str) -> Path:
    """Held-out success against env steps for every seed, and their mean. curves: seed -> (initial eval, metrics rows).
    The mean is taken at the evaluations every seed shares (same iterations), drawn at the seeds' mean env steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    per_seed: dict[int, dict[int, tuple[float, float]]] = {}  # seed -> iteration -> (env steps, success)
    for seed, (initial, rows) in sorted(curves.items()):
        points = {0: (0.0, initial["eval/success_rate"])} if initial else {}
        points |= {
            int(r["iteration"]): (float(r["rollout/total_env_steps"]), r["eval/success_rate"])
            for r in rows
            if r.get("eval/success_rate") is not None
        }
        per_seed[seed] = points
        xy = np.array([points[i] for i in sorted(points)])
        ax.plot(xy[:, 0], xy[:, 1], "o-", alpha=0.45, markersize=3, label=f"seed {seed}")
    shared = sorted(set.intersection(*(set(points) for points in per_seed.values())))
    if len(per_seed) > 1 and shared:
        mean = np.array([np.mean([per_seed[s][i] for s in per_seed], axis=0) for i in shared])
        ax.plot(mean[:, 0], mean[:, 1], "k-", linewidth=2.5, label=f"mean of {len(per_seed)} seeds")
    return _save_success_plot(fig, ax, path, title, "held-out success (deterministic)")


# The update's own figures of each task (learner.update.task_figures, and the raw advantage spread with per-task
# normalisation) that a stalled task's line shows against the moving tasks': key pattern -> the line's name.
STALL_FIGURES = {
    "policy/task/{}/clip_share": "clip share",
    "policy/task/{}/approx_kl": "approx KL",
    "policy/task/{}/sigma_mean": "sigma",
    "policy/task/{}/action_abs_mean": "|action|",
    "values/task/{}/advantage_raw_std": "advantage std",
    "values/task/{}/explained_variance": "value EV",
    "kl_ref/task/{}/mean": "KL to reference",
}


# A task at least this successful on its training layouts over the last window is solved, not stalled: too little room
# is left above it for its success to leave the first window's interval.
SOLVED_SUCCESS = 0.95

# A first window whose interval reaches further than this from its rate holds too few episodes to tell a task that
# moves slowly from one that does not: its stall line says so.
STALL_RESOLUTION = 0.10


def window_mean(rows: list[dict], key: str) -> float:
    """The mean of `key` over the rows that have a finite value of it; NaN where none has."""
    values = [row[key] for row in rows if isinstance(row.get(key), (int, float)) and math.isfinite(row[key])]
    return float(np.mean(values)) if values else math.nan


def stalled_tasks(rows: list[dict], window: int, compare: str = "first") -> dict[str, dict]:
    """The tasks of a multi-task run whose sampling policy has not moved on its training layouts: pooled over the last
    `window` iterations' rows, its first-episode success (rollout/task/<task>/first_episode_success_rate, weighted by
    first_episodes) lies inside the 95% interval of the same over the first `window` iterations, below SOLVED_SUCCESS;
    with `compare` "first_or_previous", or inside that of the `window` iterations before the last (a task that moved
    and then stopped: its entry then holds that window's figures under "previous..." too).
    Each with both windows' figures (the first window's count of first episodes, and their mean return in each window
    where logged), and the last window's mean of the update's figures of it ("figures") and of the tasks that moved
    ("moving_figures", absent when none did); none before the run has twice `window` iterations, or without a window."""
    if not window or len(rows) < 2 * window:
        return {}
    tasks = sorted({key.split("/")[2] for key in rows[0] if key.startswith("rollout/task/") and key.endswith("/first_episodes")})
    first_rows, previous_rows, last_rows = rows[:window], rows[-2 * window : -window], rows[-window:]
    stalled = {}
    for task in tasks:
        (first, low, high, first_episodes), (last, *_) = (success_window(part, task) for part in (first_rows, last_rows))
        stall = {
            "first": first,
            "first_low": low,
            "first_high": high,
            "last": last,
            "first_episodes": first_episodes,
            "first_iterations": [rows[0]["iteration"], rows[window - 1]["iteration"]],
            "last_iterations": [rows[-window]["iteration"], rows[-1]["iteration"]],
        }
        if last >= SOLVED_SUCCESS:
            continue
        if not low <= last <= high:
            if compare == "first" or len(rows) == 2 * window:  # at twice the window, the previous window is the first
                continue
            previous, previous_low, previous_high, _ = success_window(previous_rows, task)
            if not previous_low <= last <= previous_high:
                continue
            stall |= {
                "previous": previous,
                "previous_low": previous_low,
                "previous_high": previous_high,
                "previous_iterations": [previous_rows[0]["iteration"], previous_rows[-1]["iteration"]],
            }
        returns = [window_mean(part, task_key(task, "first_episode_return", "rollout")) for part in (first_rows, last_rows)]
        if all(math.isfinite(value) for value in returns):  # its reward moving while its success does not
            stall |= {"first_return": returns[0], "last_return": returns[1]}
        stalled[task] = stall
    figures = {task: last_window_figures(rows[-window:], task) for task in tasks}
    moving = [figures[task] for task in tasks if task not in stalled]
    for task, stall in stalled.items():
        stall["figures"] = figures[task]
        if moving:
            stall["moving_figures"] = {
                name: float(np.mean([other[name] for other in moving if name in other]))
                for name in figures[task]
                if any(name in other for other in moving)
            }
    return stalled


def success_window(rows: list[dict], task: str) -> tuple[float, float, float, int]:
    """`task`'s first-episode success on its training layouts pooled over `rows` (each row weighted by its first
    episodes; a row with none, or a NaN rate, weighs nothing): (rate, Wilson 95% low, high, first episodes)."""
    trials = [
        (
            row.get(task_key(task, "first_episode_success_rate", "rollout"), math.nan),
            row.get(task_key(task, "first_episodes", "rollout"), 0.0),
        )
        for row in rows
    ]
    counted = [(rate, count) for rate, count in trials if count and math.isfinite(rate)]
    n = int(sum(count for _, count in counted))
    return (*counts_interval(sum(rate * count for rate, count in counted), n), n)


def last_window_figures(rows: list[dict], task: str) -> dict[str, float]:
    """The update's figures of `task` (STALL_FIGURES), each its mean over `rows`; those it has none of left out."""
    means = {name: window_mean(rows, key.format(task)) for key, name in STALL_FIGURES.items()}
    return {name: value for name, value in means.items() if math.isfinite(value)}


def describe_stall(task: str, stall: dict) -> str:
    """One line of a stalled task's figures (stalled_tasks): its success and its first episodes' return in both windows,
    then the update's figures of it over the last window, each beside the moving tasks' mean in brackets."""
    first, last = stall["first_iterations"], stall["last_iterations"]
    held = "previous" if "previous" in stall else "first"  # the window its last one lies inside
    interval = f"{held} window's 95% interval [{stall[held + '_low']:.2f}, {stall[held + '_high']:.2f}]"
    line = f"{task}: training-layout success {stall['first']:.2f} over iterations {first[0]:.0f}-{first[1]:.0f}"
    if held == "previous":
        previous = stall["previous_iterations"]
        line += f", then {stall['previous']:.2f} over {previous[0]:.0f}-{previous[1]:.0f}"
    line += f" and {stall['last']:.2f} over {last[0]:.0f}-{last[1]:.0f}, " + ("it moved, then stopped " if held == "previous" else "")
    line += f"inside the {interval}"
    reach = max(stall[held + "_high"] - stall[held], stall[held] - stall[held + "_low"])
    if reach > STALL_RESOLUTION and "first_episodes" in stall:
        line += (
            f" ({stall['first_episodes']} first episodes a window: a move under {reach:.2f} stays inside it, so this may be "
            "a slow task rather than a still one; a longer stall_window tells them apart)"
        )
    if "first_return" in stall:
        line += f"; first-episode return {stall['first_return']:.4g} -> {stall['last_return']:.4g}"
    figures, moving = stall.get("figures", {}), stall.get("moving_figures", {})
    if figures:
        shown = [f"{name} {value:.3g}" + (f" ({moving[name]:.3g})" if name in moving else "") for name, value in figures.items()]
        line += "; its update over the last window" + (" (the moving tasks' mean)" if moving else "") + ": " + ", ".join(shown)
    return line
