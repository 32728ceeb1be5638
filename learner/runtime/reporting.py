"""What a run reports: the banner, each iteration's row (metrics.jsonl, the Ray gauges, wandb, the console) in
iteration order with its held-out evaluation, what the run costs, and summary.json with its printed summary."""

from __future__ import annotations

import json
import os
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import ray
import yaml

from common.config import RunConfig
from common.console import log
from common.file_digests import file_sha256
from common.metrics import (
    MetricsLog,
    console_line,
    describe_stall,
    eval_metrics,
    evaluated_tasks,
    plot_learning_curve,
    plot_task_curves,
    stalled_tasks,
    task_key,
    tasks_against_start,
    why_inside,
)
from common.policy import WEIGHTS_FILE
from common.recording import VIDEO_SIZE, recording_calls, save_evaluation_videos, select_episodes
from common.storage import RunFileWriteError, write_file_atomically
from learner.bc.training import REPORT_FILE
from learner.files.manifest import reproducibility_manifest
from learner.files.run_dir import RunDirectory
from learner.runtime.actor_pool import ActorPool, PendingEvaluation
from learner.runtime.failures import LearnerDiedError
from learner.runtime.learner_handle import LearnerHandle
from learner.runtime.ray_runtime import ResourceRequest
from learner.runtime.startup import StartupClock, in_time_order
from learner.update.learner import update_shape


class CostMeter:
    """What the run costs: the resources it holds (reserved, busy or idle) times wall time, start-up included, summed
    over every launch of a resumed run. Reported per iteration (cost/...) and in summary.json."""

    def __init__(self, since: float, learner: ResourceRequest, actor: ResourceRequest, carried: dict[str, float]):
        """since: when the run began (time.perf_counter); carried: the totals of the launches a resumed run continues."""
        self.learner, self.actor, self.clock = learner, actor, since
        self.totals = {key: float(carried.get(key, 0.0)) for key in ("wall_seconds", "cpu_seconds_reserved", "gpu_seconds_reserved")}

    def charge(self, actors_held: int) -> dict[str, float]:
        """Add the time since the last charge, with `actors_held` rollout actors; returns the totals as cost/... metrics."""
        now = time.perf_counter()
        seconds, self.clock = now - self.clock, now
        self.totals["wall_seconds"] += seconds
        self.totals["cpu_seconds_reserved"] += (self.learner.num_cpus + self.actor.num_cpus * actors_held) * seconds
        self.totals["gpu_seconds_reserved"] += (self.learner.num_gpus + self.actor.num_gpus * actors_held) * seconds
        return {f"cost/{key}": value for key, value in self.totals.items()}

    def final(self, actors_held: int) -> dict[str, float]:
        """The totals at the run's end, after a last charge."""
        self.charge(actors_held)
        return dict(self.totals)


@dataclass
class Evaluation:
    """A held-out evaluation submitted to the actors, under the label its "[eval:...]" line prints."""

    pending: PendingEvaluation
    label: str
    submitted: float  # time.perf_counter() after its submission
    iteration: int  # the iteration whose weights it evaluates (0: the initial policy)


class Evaluator:
    """Held-out evaluations on the rollout actors: submitted without waiting, collected when their row is written."""

    def __init__(self, pool: ActorPool, eval_layouts: list, films: EvaluationFilms | None = None):
        self.pool, self.eval_layouts, self.films = pool, eval_layouts, films

    def submit(self, weights_ref: ray.ObjectRef, label: str, iteration: int) -> Evaluation:
        return Evaluation(self.pool.submit_evaluate(weights_ref, self.eval_layouts), label, time.perf_counter(), iteration)

    def finished(self, evaluation: Evaluation) -> bool:
        return self.pool.finished(evaluation.pending.call)

    def collect(self, evaluation: Evaluation) -> dict[str, float]:
        """Wait for a submitted evaluation; its eval/... metrics, printed. Its episodes to film are asked for then."""
        t0 = time.perf_counter()
        successes, versions = self.pool.collect_evaluate(evaluation.pending)
        result = eval_metrics(successes, self.eval_layouts)
        result["eval/wait_seconds"] = time.perf_counter() - t0  # what the driver spent blocked on it
        log.info(
            f"[eval:{evaluation.label}] held-out {format_eval(result)}, weights v{sorted(versions)}, "
            f"{time.perf_counter() - evaluation.submitted:.1f}s after submission ({result['eval/wait_seconds']:.1f}s waited)"
        )
        if self.films is not None:
            self.films.submit(evaluation, successes)
        return result

    def run(self, weights_ref: ray.ObjectRef, label: str, iteration: int) -> dict[str, float]:
        return self.collect(self.submit(weights_ref, label, iteration))


class EvaluationFilms:
    """Videos of held-out episodes (config.eval_videos per task: first success, first failure) after each evaluation.

    The actors film them in the batches the evaluation ran them in (common.recording), while training goes on; they
    are written to run_dir/videos/iter_XXXXXX/ as they come in and logged to wandb. Filming changes nothing that is
    evaluated or trained, and a failed filming is a warning, never the run's end."""

    def __init__(self, config: RunConfig, pool: ActorPool, eval_layouts: list, run_dir: Path, wandb_run: Any):
        self.per_task, self.pool, self.eval_layouts = config.eval_videos, pool, eval_layouts
        self.run_dir, self.wandb_run = run_dir, wandb_run
        self.pending: deque[tuple[int, list[ray.ObjectRef]]] = deque()  # (iteration, record_episodes refs)

    def submit(self, evaluation: Evaluation, successes: np.ndarray) -> None:
        chosen = select_episodes([layout.task for layout in self.eval_layouts], successes, self.per_task)
        refs = []
        for actor, share, positions in recording_calls(evaluation.pending.shares, chosen):
            index = actor if actor in self.pool.actors else min(self.pool.actors)  # a dropped actor's share: any actor films alike
            layouts = [self.eval_layouts[i] for i in share]
            refs.append(self.pool.actors[index].record_episodes.remote(evaluation.pending.weights_ref, layouts, VIDEO_SIZE, positions))
        self.pending.append((evaluation.iteration, refs))

    def save(self, wait: bool) -> None:
        """Write the films that are in (all of them, if `wait`), in iteration order."""
        while self.pending:
            iteration, refs = self.pending[0]
            if not wait and len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) < len(refs):
                return
            self.pending.popleft()
            try:
                recordings = [recording for ref in refs for recording in ray.get(ref)]
            except ray.exceptions.RayError as exc:
                warnings.warn(f"the videos of iteration {iteration} were not filmed: {str(exc).splitlines()[0]}", stacklevel=2)
                continue
            paths = save_evaluation_videos(self.run_dir, iteration, recordings)
            if paths:
                log.info(f"[videos] iteration {iteration}: {len(paths)} held-out episodes in {paths[0].parent}")
            if self.wandb_run is not None and paths:
                import wandb

                videos = {f"eval/video/{path.stem}": wandb.Video(str(path), format="mp4") for path in paths}
                self.wandb_run.log(videos, commit=False)  # shown with the next iteration's row


HELD_ROWS_FILE = "held_rows.json"  # rows a checkpoint passed before they were logged (MetricsRows.keep_held)


class MetricsRows:
    """Each iteration's row, written in iteration order to metrics.jsonl, the Ray gauges, wandb and the console.

    Held-out evaluations do not stop training: one is submitted to the actors after its iteration's weights are
    published and collected once finished, while the learner trains on. An evaluated iteration's row (and those after
    it) waits for its evaluation. A checkpoint may not pass a row that is nowhere on disk (a resume would never redo its
    iteration): before each one the held rows are written, as they are, to held_rows.json beside the log, and a resumed
    run logs those its checkpoint covers and the log lacks (`recover`)."""

    def __init__(self, log: MetricsLog, evaluator: Evaluator, learner: LearnerHandle, wandb_run: Any, single_batch: bool):
        """wandb_run: None for no wandb; single_batch: each row is also printed whole."""
        self.log, self.evaluator, self.learner, self.wandb_run, self.single_batch = log, evaluator, learner, wandb_run, single_batch
        self.held: deque[tuple[dict[str, float], Evaluation | None]] = deque()
        self.held_file = log.path.with_name(HELD_ROWS_FILE)

    def add(self, row: dict[str, float], evaluation: Evaluation | None, wait: bool) -> None:
        """Hold an iteration's row (with its submitted evaluation), then write what is ready (everything, if `wait`)."""
        self.held.append((row, evaluation))
        self.write(wait)

    def write(self, wait: bool) -> None:
        """Write the held rows in order; a row whose evaluation is unfinished stops there, unless `wait`."""
        while self.held:
            row, evaluation = self.held[0]
            if evaluation is not None:
                if not wait and not self.evaluator.finished(evaluation):
                    return
                row.update(self.evaluator.collect(evaluation))
            if self.evaluator.films is not None:
                self.evaluator.films.save(wait=False)
            self.log.write(row)
            self.held.popleft()  # after the write: a row the disk refused is still held
            self.learner.export_gauges(row)
            if self.wandb_run is not None:
                self.wandb_run.log(row, step=int(row["iteration"]))
            log.info(console_line(row))
            if self.single_batch:
                log.info(json.dumps(row, indent=1, sort_keys=True))
        self.held_file.unlink(missing_ok=True)  # every row it kept is in the log now

    def completed(self) -> list[dict[str, float]]:
        """Every completed iteration's row in order, those held for their evaluations included (without them): what a
        check after an iteration reads, whether or not an evaluation submitted at it has finished."""
        return self.log.read() + [dict(row) for row, _ in self.held]

    def keep_held(self, row: dict[str, float]) -> None:
        """The held rows, without their unfinished evaluations, and `row`, the iteration's not added yet, in
        held_rows.json (replaced whole): called before a checkpoint that passes them, so that a run killed after it still
        logs their iterations once resumed."""
        rows = [dict(held) for held, _ in self.held] + [dict(row)]
        write_file_atomically(self.held_file, json.dumps(rows), RunFileWriteError)

    def recover(self, checkpoint_iteration: int) -> None:
        """On resume from the checkpoint of `checkpoint_iteration`: the rows held_rows.json kept for iterations it covers
        and the log lacks (the last launch was killed before it wrote them), logged as they were kept."""
        if not self.held_file.is_file():
            return
        logged = {int(row["iteration"]) for row in self.log.read()}
        kept = [
            row
            for row in json.loads(self.held_file.read_text())
            if int(row["iteration"]) <= checkpoint_iteration and int(row["iteration"]) not in logged
        ]
        for row in kept:
            self.log.write(row)
        if kept:
            iterations = ", ".join(str(row["iteration"]) for row in kept)
            log.info(
                f"[resume] logged iteration {iterations} as the last launch held it when it stopped (its held-out evaluation, "
                "unfinished then, is not in it)"
            )
        self.held_file.unlink()

    def after_learner_restart(self, iteration: int, weights_ref: ray.ObjectRef) -> None:
        """Settle the held rows once a new learner has started from the checkpoint of `iteration`: those after it are
        dropped (their iterations are redone); the rest are written once their evaluations are in. An evaluation whose
        actors had not fetched its weights when their learner died is lost with it: the checkpoint's own iteration is
        evaluated again with the new learner's `weights_ref` (the same version, from that checkpoint); an earlier one
        cannot be, and its row is written without it, with a warning."""
        held, self.held = self.held, deque()
        for row, evaluation in held:
            if row["iteration"] > iteration:
                continue
            if evaluation is not None:
                try:
                    row.update(self.evaluator.collect(evaluation))
                except LearnerDiedError:
                    if row["iteration"] == iteration:
                        row.update(self.evaluator.run(weights_ref, f"{evaluation.label}, again", iteration))
                    else:
                        warnings.warn(
                            f"the evaluation of iteration {row['iteration']} was lost with the learner that "
                            "published its weights: its row has none",
                            RuntimeWarning,
                            stacklevel=2,
                        )
            self.held.append((row, None))
        self.write(wait=True)

    def keep_completed(self) -> None:
        """Write the held rows as they are: a run that stops keeps its completed iterations, not their unfinished evaluations;
        its wandb run is closed as failed, so that `--resume` can carry the same wandb run on at once."""
        for row, _ in self.held:
            self.log.write(row)
        if self.wandb_run is not None:
            self.wandb_run.finish(exit_code=1)

    def close(self) -> None:
        if self.evaluator.films is not None:
            self.evaluator.films.save(wait=True)
        if self.wandb_run is not None:
            self.wandb_run.finish()


class StallWatch:
    """A multi-task run's stalled tasks on the console, each named once, as its window comes round
    (common.metrics.stalled_tasks over the rows logged so far)."""

    def __init__(self, window: int, compare: str = "first"):
        self.window, self.compare, self.named = window, compare, set()

    def check(self, iteration: int, completed_rows: Callable[[], list[dict[str, float]]]) -> list[str]:
        """The tasks named stalled for the first time after `iteration` completed iterations, whose rows
        `completed_rows()` gives (read only when a window comes round)."""
        if not self.window or iteration % self.window or iteration < 2 * self.window:
            return []
        named = []
        for task, stall in stalled_tasks(completed_rows(), self.window, self.compare).items():
            if task not in self.named:
                log.info(f"[stall] {describe_stall(task, stall)}")
                self.named.add(task)
                named.append(task)
        return named


class RunSummary:
    """summary.json: the run's manifest, start-up stages, held-out evaluations, faults and cost. A resumed run carries on
    from the summary its earlier launches wrote."""

    def __init__(self, directory: RunDirectory, resume: bool):
        self.path = directory.path / "summary.json"
        self.data: dict[str, Any] = json.loads(self.path.read_text()) if resume and self.path.is_file() else {}

    def write(self) -> None:
        """summary.json replaced whole (a temporary file renamed over it): a full disk leaves the previous one as it was
        and raises RunFileWriteError."""
        write_file_atomically(self.path, json.dumps(self.data, indent=2), RunFileWriteError)

    def begin(self, config: RunConfig, checkpoint: Path | None, eval_layouts: list) -> None:
        """A new run's manifest."""
        self.data["manifest"] = reproducibility_manifest(config, checkpoint, eval_layouts)

    def note_initial_eval(self, result: dict[str, float]) -> None:
        """The initial policy's evaluation, written at once: kept if the run stops."""
        self.data["initial_eval"] = result
        self.write()

    def note_stall_demonstrations(self, tasks: list[str], iteration: int, config: RunConfig) -> None:
        """Stalled tasks whose demonstrations join the updates from iteration `iteration` (0-based), on the console and in
        the summary (stall_demonstrations: task -> the first iteration, 1-based, whose update has them)."""
        cfg = config.algorithm
        for task in tasks:
            log.info(
                f"[stall] {task}: {cfg.stall_demos} scripted demonstrations of it join every update from iteration {iteration + 1} "
                f"(algorithm.stall_demos; their flow-matching loss x {cfg.stall_bc_coef:g})"
            )
            self.data.setdefault("stall_demonstrations", {})[task] = iteration + 1
        if tasks:
            self.write()

    def note_first_rollout(self, clock: StartupClock) -> None:
        """The start-up's last stage, the first rollout collected: the stages are complete (a no-op after the first)."""
        if "first_rollout" in clock.stages:
            return
        clock.reached("first_rollout")
        self.data["startup"] = in_time_order(clock.stages)
        log.info(f"[start] first rollout in {clock.stages['first_rollout']:.1f}s ({clock})")

    def finish(
        self,
        config: RunConfig,
        rows: list[dict],
        env_steps: int,
        wall_seconds: float,
        checkpoint: Path | None,
        faults: dict[str, float],
        cost: dict[str, float],
    ) -> None:
        """The run's end: its totals and final evaluation (the last row's), written. wall_seconds: of this launch."""
        final_eval = {k: rows[-1][k] for k in rows[-1] if k.startswith("eval/")} if rows else {}
        self.data.update(
            {
                "iterations": config.iterations,
                "env_steps": env_steps,
                "final_eval": final_eval,
                "wall_seconds_this_launch": wall_seconds,
                "config_fingerprint": config.fingerprint(),
                "init_checkpoint": str(checkpoint) if checkpoint else self.data.get("init_checkpoint"),
                "faults": faults,
            }
        )
        self.data["cost"] = {**cost, "env_steps": env_steps, "gpu_hours_reserved": cost["gpu_seconds_reserved"] / 3600}
        if stalls := stalled_tasks(rows, config.stall_window, config.stall_compare):
            self.data["stalled_tasks"] = stalls
        start = checkpoint or (Path(self.data["init_checkpoint"]) if self.data.get("init_checkpoint") else None)
        used = demonstrations_used(start, config, self.data.get("stall_demonstrations", {}))
        if used:
            self.data["demonstrations"] = used
        if "initial_eval" in self.data and final_eval:
            self.data["success_gain"] = final_eval["eval/success_rate"] - self.data["initial_eval"]["eval/success_rate"]
            if evaluated_tasks([final_eval]):
                placed = self.data["tasks_against_initial"] = tasks_against_start(self.data["initial_eval"], final_eval)
                self.data["inside_tasks"] = why_inside(
                    self.data["initial_eval"],
                    placed["inside"],
                    self.data.get("stalled_tasks", {}),
                    self.data.get("stall_demonstrations", {}),
                )
        self.write()

    def plot_and_print(self, config: RunConfig, rows: list[dict], run_dir: Path) -> None:
        """The learning curve (its path under "curve", not written to summary.json), and the summary printed."""
        title = f"{config.env.task}: {config.algorithm.algo.upper()} fine-tuning"
        self.data["curve"] = str(plot_learning_curve(rows, run_dir / "learning_curve.png", title, self.data.get("initial_eval")))
        task_curves = plot_task_curves(rows, run_dir / "task_curves.png", f"{title}, per task", self.data.get("initial_eval"))
        if task_curves is not None:
            self.data["task_curves"] = str(task_curves)
        print_summary(self.data)


def demonstrations_used(start: Path | None, config: RunConfig, stalled: dict[str, int]) -> dict[str, int] | None:
    """The scripted demonstrations of each task the run learnt from: those its behaviour-cloned start was cloned from
    (its pretrain.json) and, for a task named stalled, algorithm.stall_demos (the first layouts of the same benchmark
    seed, so a task's count is the larger of the two). What RL adds is what the run reaches beyond cloning these alone
    (`python -m learner.pretrain --set 'pretrain.task_demos={...}'`). None for a start cloned from a dataset or
    not cloned here (a lerobot checkpoint)."""
    report_file = None if start is None else start / REPORT_FILE
    if report_file is None or not report_file.is_file():
        return None
    report = json.loads(report_file.read_text())
    pretrain = report.get("config", {}).get("pretrain", {})
    if pretrain.get("dataset") or "demos" not in report:
        return None
    counts = dict(report.get("demos_per_task") or {config.env.task: report["demos"]})
    for task in stalled:
        counts[task] = max(counts.get(task, 0), config.algorithm.stall_demos)
    return counts


# ---------------------------------------------------------------------------------------------- output


class _OneLine(dict):
    """A mapping the banner writes on one line (YAML flow style)."""


class _BannerDumper(yaml.SafeDumper):
    pass


_BannerDumper.add_representer(_OneLine, lambda dumper, data: dumper.represent_mapping("tag:yaml.org,2002:map", data, flow_style=True))


def applicable_config(config: RunConfig) -> dict[str, Any]:
    """The config as the banner shows it: without the subsections of the policy backends the run does not use
    (policy.smolvla on an MLP run, env.gym on Metaworld) and the fields its algorithm does not read, and with the speed
    and fault knobs of actors and learner one subsection a line, so that the recipe stands out. The recorded config
    keeps everything."""
    data = config.to_dict()
    for name in config.policy.unused_sections():
        del data["policy"][name]
    for name in config.env.unused_sections():
        del data["env"][name]
    for name in config.algorithm.unused_fields():
        del data["algorithm"][name]
    for section in ("actors", "learner"):
        for knobs in ("speed", "faults"):
            data[section][knobs] = _OneLine(data[section][knobs])
    return data


def banner(config: RunConfig, checkpoint: Path | None, resume_dir: Path | None, resources: dict[str, float], cpus_per_actor: float) -> str:
    lines = ["=" * 78, "flowrl: ReinFlow-style PPO fine-tuning of a flow policy", "=" * 78]
    lines.append(yaml.dump(applicable_config(config), Dumper=_BannerDumper, sort_keys=False, width=120).rstrip())
    lines.append("-" * 78)
    lines.append(f"config fingerprint : {config.fingerprint()}")
    lines.append(f"ray resources      : {resources}")
    lines.append(f"  per actor        : {cpus_per_actor:.4g} CPU, {config.actors.num_gpus} GPU, custom {config.actors.resources}")
    ranks = config.learner.num_learners
    group = f"; a group of {ranks} ranks, each with that (learner.num_learners)" if ranks > 1 else ""
    lines.append(f"  learner          : {config.learner.num_gpus} GPU, custom {config.learner.resources}{group}")
    if checkpoint is not None:
        lines.append(f"init checkpoint    : {checkpoint} (sha256 {file_sha256(checkpoint / WEIGHTS_FILE)[:16]})")
        report = checkpoint / REPORT_FILE
        if report.is_file():
            data = json.loads(report.read_text())
            lines.append(
                f"  pre-training     : {data['demos']} demos, held-out success {data['eval_success_rate']:.2f} ({data['eval_layouts']})"
            )
    if resume_dir is not None:
        lines.append(f"resuming from      : {resume_dir}")
    p = config.policy
    lines.append(
        f"log-prob           : {p.log_prob_normalization} over {p.num_steps} steps x {p.chunk_size}x{p.action_dim} elements;"
        f" sigma in [{p.sigma_min}, {p.sigma_max}]; clip {config.algorithm.clip_eps}"
    )
    lines.append(f"update             : {update_shape(config)}")
    lines.append("=" * 78)
    return "\n".join(lines)


def init_wandb(config: RunConfig, run_dir: Path, resume: bool):
    os.environ.setdefault("WANDB_MODE", "offline")  # offline by default; WANDB_MODE=online/disabled respected
    if os.environ["WANDB_MODE"] == "disabled":
        return None
    import wandb

    run_id_file = run_dir / "wandb_run_id"
    run_id = run_id_file.read_text().strip() if resume and run_id_file.is_file() else None
    run = wandb.init(project=config.wandb_project, dir=str(run_dir), config=config.to_dict(), id=run_id, resume="allow" if run_id else None)
    run_id_file.write_text(run.id)
    return run


def format_eval(result: dict[str, float]) -> str:
    return (
        f"success {result['eval/success_rate']:.3f} (95% CI {result['eval/success_low']:.3f}-{result['eval/success_high']:.3f})"
        f" on {int(result['eval/episodes'])} layouts"
    )


def print_summary(summary: dict[str, Any]) -> None:
    log.info("=" * 78)
    initial, final = summary.get("initial_eval"), summary.get("final_eval")
    if initial:
        log.info(f"initial policy : {format_eval(initial)}")
    if final:
        log.info(f"after RL       : {format_eval(final)}")
    if "success_gain" in summary:
        log.info(f"gain           : {summary['success_gain']:+.3f} on the same {int(final['eval/episodes'])} held-out layouts")
    for task in evaluated_tasks([final] if final else []):
        rate, low, high = (final[task_key(task, name)] for name in ("success_rate", "success_low", "success_high"))
        before = f"{initial[task_key(task, 'success_rate')]:.2f} -> " if initial and task_key(task, "success_rate") in initial else ""
        log.info(f"  {task:<26}: {before}{rate:.2f} [{low:.2f}, {high:.2f}]")
    if placed := summary.get("tasks_against_initial"):
        log.info(
            f"tasks          : {len(placed['above'])} of {sum(map(len, placed.values()))} above their initial interval, "
            f"{len(placed['below'])} below{' (' + ', '.join(placed['below']) + ')' if placed['below'] else ''}"
        )
    for task, stall in summary.get("stalled_tasks", {}).items():
        log.info(f"stalled        : {describe_stall(task, stall)}")
    for task, reason in summary.get("inside_tasks", {}).items():
        log.info(f"inside         : {task}: {reason}")
    if counts := summary.get("demonstrations"):
        fewest = min(counts.values())
        more = ", ".join(f"{task}: {count}" for task, count in counts.items() if count != fewest)
        clone = f"--set pretrain.num_demos={fewest}" + (f" --set 'pretrain.task_demos={{{more}}}'" if more else "")
        log.info(
            f"demonstrations : {sum(counts.values())} learnt from; set the gain beside cloning them alone: "
            f"python -m learner.pretrain <this run's --config and --set> {clone} --out DIR"
        )
    log.info(f"env steps      : {summary['env_steps']}, wall {summary['wall_seconds_this_launch']:.0f}s; curve: {summary.get('curve')}")
    if summary.get("task_curves"):
        log.info(f"per-task curves: {summary['task_curves']}")
    log.info("=" * 78)
