"""SmolVLA at smolvla_base's size through the loop's own pieces on one GPU, without Ray: the recipe of
configs/smolvla_pick.yaml (3 cameras at 256 px, 50-action chunks, 10 denoising steps, a bfloat16 actor and the
learner's fast path; pi0's and pi0.5's recipes keep a float32 learner), timed stage by stage, with the numerics the
learner checks.

    python bench/smolvla_gpu.py                 # full size; needs a GPU (a chunk takes tens of seconds on CPU)
    python bench/smolvla_gpu.py --size tiny     # the same path with the tiny VLM, on CPU (tests/integration/test_bench.py)
    python bench/smolvla_gpu.py --recipe configs/pi0_pick.yaml [--size tiny]   # pi0 (pi05_pick.yaml: pi0.5); lerobot 0.6

Nothing downloads. The backbone directory is written offline at SmolVLM2-500M's shapes
(common.policy.smolvla.stand_ins.SMOLVLM2_500M_SHAPES). A stand-in for smolvla_base, a lerobot SmolVLA checkpoint with
random tensors at its shapes (max_state_dim 32), is saved with lerobot's own save_pretrained and loaded strictly
as the config's lerobot_checkpoint with reinit_state_proj, as a real smolvla_base would be. The weights are
random, so the figures are about cost and numerics (the ratio check, the bfloat16 behaviour gap, memory), not
learning.

Stages: write the backbone and the stand-in, load it strictly and save the policy checkpoint; chunk-decision
latency of the bfloat16 actor at several batch sizes; one RolloutActor samples `--rollouts` rollouts with version
0 (as that many actors would, each with its own seed); the Learner updates on all of them (an update that trains
the actor: the recipe's critic warm-up, whose updates take no gradient through the chains, is left out); the actor loads
version 1 and samples again; the learner scores that rollout (behaviour gap at the new version). Prints JSON, then
`name: value` lines; a failing stage is reported (`<stage>/error`) and the stages that do not depend on it still run.
On CPU an update also reports the ATen ops it dispatched (`aten_ops`), so `--update-variants
"learner.speed.steps_in_one_pass=true"` shows the host work of scoring the denoising steps in one pass beside step by step,
and its floating-point operations (`flops`, `scoring_pass_flops`, `vision_flops`). Each batch size's decision reports
its FLOPs (`batch<N>_flops`, the encode's and the vision tower's apart) and the TFLOP/s each path reaches: a GPU's
arithmetic set against its time. FLOPs depend on the shapes only, so a full-size run on CPU counts them for a GPU.
`--compile-steps` times each decision path again with its denoising steps compiled by torch.compile
(actors.speed.compile_steps): `eager_compiled_*` (and on a GPU `graph_compiled_*`), with the compile's first call, the
kernels the compiler generated for a step, and the outputs against the eager path's on the same noise.
`--compile-vision` adds `<path>_compiled_vision`, with the vision tower compiled as well (actors.speed.compile_vision), and
its speedup over `<path>_compiled`. `--fused-attention` times every path again with the attention of the VLM's
prefix and the expert's steps through one fused kernel (actors.speed.fused_attention): `<path>_fused`, and its speedup
over `<path>`. An update variant with "learner.speed.compile_steps=true" or "learner.speed.compile_vision=true"
first runs an update of its own that compiles (`first_update_seconds`), then times the update as the others
(`graphs_compiled`: 0, none new). Every update reports the bytes its learner holds (`parameter_bytes`,
`gradient_bytes`, `optimizer_bytes`: Learner.state_bytes) and, uncompiled, the most bytes of activations it held at once
for its backward passes (`saved_for_backward_peak_bytes`: shapes alone set it, so a CPU run reads a GPU's), so
`--update-variants "learner.speed.fused_attention=true"` shows what the attention through one fused kernel keeps
beside the eager attention lerobot runs. A variant that sets an actors field samples its own rollouts of the same seeds
by an actor of its own first, so `--update-variants "actors.speed.send_image_embeddings=true"` sets the update on records
of the vision tower's tokens (`sample_record_bytes_per_decision`) beside the update on frames. `--group-of-one N` times
the recipe's update N times by a learner alone and N times by the learner group's code path with one rank
(learner.group.ranks.RankGroup, its collectives over a one-process torch.distributed group: NCCL on a GPU, gloo on
CPU), fresh learners taking turns on the same rollouts: `group_of_one/over_alone` is the ratio of their median seconds,
`max_abs_weight_difference` how far the last two updates' trainable weights lie apart.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch._dynamo.utils import counters
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from bench.op_count import OpCounter
from bench.report import REPO_ROOT, emit, ratio, record_arrays
from common.config import PolicyConfig, RunConfig
from common.config_loading import apply_override, from_dict, load_config
from common.diagnostics import BehaviourGapWarning
from common.observation import Observation
from common.policy import FlowPolicy, build_policy, write_directory_atomically
from common.policy.smolvla.stand_ins import SMOLVLM2_500M_SHAPES, TinyVLMSpec, write_tiny_vlm
from common.trajectory import RolloutBatch
from learner.group.ranks import RankGroup, free_address, join_learner_group

RECIPE = REPO_ROOT / "configs" / "smolvla_pick.yaml"
OPTIONAL_STAGES = ("decision_latency", "prepare", "publish_load_sample_v1")  # --skip: what a short GPU run can leave out
# --size tiny: the same stages at test size (CPU, small frames, chunks and batches), with the tiny VLM of 2 text layers
# (SmolVLA) or the tiny PaliGemma and expert (pi0, pi0.5).
TINY_SETS = (
    "policy.image_size=32", "policy.chunk_size=4", "policy.num_steps=2", "actors.envs_per_actor=1", "actors.decisions_per_rollout=2",
    "algorithm.minibatch_size=4", "algorithm.grad_accum=2", "algorithm.update_epochs=1", "env.max_episode_steps=20",
)  # fmt: skip
SMOLVLA_TINY_SETS = ("policy.smolvla.num_vlm_layers=2",)
PI05_CHARACTER_PROMPT_TOKENS = 256
PI_TINY_SETS = ("policy.pi0.paligemma_variant=tiny", "policy.pi0.action_expert_variant=tiny_expert", "policy.pi0.image_resolution=32",
                "policy.pi0.max_action_dim=4", "policy.hidden_dim=32")  # fmt: skip


class Clock:
    """Wall seconds of a block, synchronising the GPU first so queued kernels are counted where they ran."""

    def __init__(self, device: torch.device):
        self.device = device

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def gpu_memory(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    gib = 2.0**30
    return {
        "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / gib,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / gib,
    }


def run_stage(results: dict[str, Any], name: str, stage: Callable[[], dict[str, Any]], device: torch.device) -> bool:
    """Run one stage into results[name]; on an exception record it and go on (one GPU run, every figure it can give)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    print(f"[smolvla_gpu] {name} ...", file=sys.stderr, flush=True)
    try:
        results[name] = {**stage(), **gpu_memory(device)}
        print(f"[smolvla_gpu] {name}: {json.dumps(results[name])}", file=sys.stderr, flush=True)  # kept if a later stage hangs
        return True
    except Exception as exc:  # noqa: BLE001 - reported, and the remaining stages still measure what they can
        traceback.print_exc()
        results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        return False


def write_lerobot_stand_in(directory: str | Path, config: PolicyConfig, device: str | torch.device = "cpu") -> Path:
    """A lerobot-format pi0 / pi0.5 checkpoint (lerobot's own save_pretrained: config.json + model.safetensors) of the
    model `config` describes, with random weights: a stand-in for pi0_base / pi05_base at their real sizes where the
    real weights are not at hand (GPU benchmarks). Built on `device` (lerobot's full sizes initialise far faster on a
    GPU); policy.pi0.lerobot_checkpoint = `directory` then loads it strictly, with pi_tokenizer_dir(PALIGEMMA_VOCAB)
    as the tokenizer."""
    from common.policy.pi0.model import PiFlowPolicy  # lerobot 0.6 only: imported when a pi0 recipe is measured

    config = dataclasses.replace(config, pi0=dataclasses.replace(config.pi0, lerobot_checkpoint="", reinit_state_proj=False))
    with torch.device(device):
        policy = PiFlowPolicy(config)
    policy.vla.save_pretrained(Path(directory))
    return Path(directory)


def write_inputs(work: Path, size: str, sets: list[str], recipe: Path) -> tuple[RunConfig, Path, dict[str, Any]]:
    """The offline backbone/tokenizer directory, a stand-in for the recipe's lerobot checkpoint, the run config that
    loads it (strictly), and the policy saved as a run saves its checkpoints (with checksums, which every load verifies)."""
    if load_config(recipe).policy.type == "smolvla":
        config = write_smolvla_stand_in(work, size, sets, recipe)
    else:
        config = write_pi_stand_in(work, size, sets, recipe)
    policy = build_policy(config.policy)  # the strict load of the stand-in
    checkpoint = write_directory_atomically(work / "checkpoint", policy.save_pretrained)
    counts = {
        "parameters": sum(p.numel() for p in policy.parameters()),
        "trainable_parameters": sum(p.numel() for p in policy.parameters() if p.requires_grad),
        "broadcast_mib": policy.broadcast_bytes() / 2.0**20,
    }
    return config, checkpoint, counts


def write_smolvla_stand_in(work: Path, size: str, sets: list[str], recipe: Path) -> RunConfig:
    """A SmolVLM backbone directory at SmolVLM2-500M's shapes (or tiny) and a smolvla_base stand-in."""
    spec = SMOLVLM2_500M_SHAPES if size == "full" else TinyVLMSpec(image_size=32)
    vlm_dir = write_tiny_vlm(work / "vlm", spec)
    stand_in = work / "smolvla_base_stand_in"
    tiny = (*TINY_SETS, *SMOLVLA_TINY_SETS) if size == "tiny" else ()
    base_sets = [f"policy.smolvla.vlm_path={vlm_dir}", "policy.smolvla.lerobot_checkpoint=''", *tiny, *sets]
    # smolvla_base's own state width: the recipe's reinit_state_proj then re-initialises state_proj at 39.
    saved_as = load_config(
        recipe, [*base_sets, "policy.obs_dim=32", "policy.smolvla.max_state_dim=32", "policy.smolvla.reinit_state_proj=false"]
    )
    torch.manual_seed(0)
    build_policy(saved_as.policy).vla.save_pretrained(stand_in)
    return load_config(recipe, [*base_sets, f"policy.smolvla.lerobot_checkpoint={stand_in}"])


def write_pi_stand_in(work: Path, size: str, sets: list[str], recipe: Path) -> RunConfig:
    """A pi0 / pi0.5 stand-in at the recipe's (full) sizes, built on the GPU when there is one, and the offline
    tokenizer at PaliGemma's vocabulary size."""
    from common.policy.pi0.stand_ins import PALIGEMMA_VOCAB, pi_tokenizer_dir

    if size == "full":
        base_sets = [f"policy.pi0.tokenizer_path={pi_tokenizer_dir(PALIGEMMA_VOCAB)}", "policy.pi0.lerobot_checkpoint=''", *sets]
    else:  # the tiny PaliGemma and expert; an empty tokenizer_path writes the character tokenizer at their vocabulary
        base_sets = ["policy.pi0.tokenizer_path=''", "policy.pi0.lerobot_checkpoint=''", *PI_TINY_SETS, *TINY_SETS, *sets]
    if load_config(recipe).policy.type == "pi05":
        # The offline tokenizer spells the prompt's 39 state bins a character a token (about 225 tokens for pick-place),
        # where PaliGemma's own needs far fewer: a longer prompt than the recipe's, so these figures err on the slow side.
        base_sets.insert(0, f"policy.pi0.tokenizer_max_length={PI05_CHARACTER_PROMPT_TOKENS}")
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() and size == "full" else "cpu"
    stand_in = write_lerobot_stand_in(work / "pi_stand_in", load_config(recipe, base_sets).policy, device=device)
    if device == "cuda":
        torch.cuda.empty_cache()
    return load_config(recipe, [*base_sets, f"policy.pi0.lerobot_checkpoint={stand_in}"])


class LaunchProfile(torch.profiler.profile):
    """The profiler over one decision on a GPU: ATen ops dispatched, CUDA kernel and graph launches, and the seconds
    the GPU spent in kernels (what its table totals as self CUDA time): against the decision's wall time, how busy
    the GPU was; against its FLOPs, how fast its kernels ran."""

    def counts(self) -> dict[str, float]:
        counts, kernel_microseconds = {"aten_ops": 0, "kernel_launches": 0, "graph_launches": 0}, 0
        for event in self.key_averages():
            if event.device_type == torch.autograd.DeviceType.CUDA and not event.is_user_annotation:
                kernel_microseconds += event.self_device_time_total
            if event.key.startswith("aten::"):
                counts["aten_ops"] += event.count
            elif event.key in ("cudaLaunchKernel", "cuLaunchKernelEx", "cuLaunchKernel", "cudaLaunchKernelExC"):
                counts["kernel_launches"] += event.count
            elif event.key == "cudaGraphLaunch":
                counts["graph_launches"] += event.count
        if kernel_microseconds:  # none where the profiler did not see the kernels (inside a graph, on some setups)
            counts["kernel_seconds"] = kernel_microseconds / 1e6
        return counts


def host_work_counter(device: torch.device) -> LaunchProfile | OpCounter:
    """What one decision asks of the host: the profiler's counts on a GPU, the dispatched ops on CPU."""
    return LaunchProfile() if device.type == "cuda" else OpCounter()


# torch counts the attention kernels of a GPU; on CPU, SDPA runs these, whose arguments start as the GPU kernels' do.
CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: lambda query, key, value, *_, **__: sdpa_flop_count(query, key, value),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: (
        lambda grad_out, query, key, value, *_, **__: sdpa_backward_flop_count(grad_out, query, key, value)
    ),
}


class SavedForBackward(torch.autograd.graph.saved_tensors_hooks):
    """The activations a learner keeps for its backward passes: the most bytes of tensors autograd holds at once for
    them, each storage counted once, parameters left out (they are held anyway). It depends on the shapes and the code
    path, not the device, so a CPU run reads what a GPU would hold (beyond what its kernels allocate on the way)."""

    class Held:
        def __init__(self, tensor: Tensor):
            self.tensor = tensor

    def __init__(self) -> None:
        self.held: dict[int, list[int]] = {}  # storage address -> [bytes, tensors holding it]
        self.bytes = self.peak_bytes = 0
        super().__init__(self.pack, lambda held: held.tensor)

    def pack(self, tensor: Tensor) -> Any:
        if isinstance(tensor, torch.nn.Parameter):
            return self.Held(tensor)
        storage = tensor.untyped_storage()
        entry = self.held.setdefault(storage.data_ptr(), [storage.nbytes(), 0])
        if entry[1] == 0:
            self.bytes += entry[0]
            self.peak_bytes = max(self.peak_bytes, self.bytes)
        entry[1] += 1
        held = self.Held(tensor)
        weakref.finalize(held, self.release, storage.data_ptr())
        return held

    def release(self, address: int) -> None:
        entry = self.held[address]
        entry[1] -= 1
        if entry[1] == 0:
            self.bytes -= self.held.pop(address)[0]


def flop_counter() -> FlopCounterMode:
    return FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS)


def vision_flops(counter: FlopCounterMode) -> int:
    """The part of a FlopCounterMode's count in a vision tower: the modules whose class names a vision transformer."""
    return sum(sum(ops.values()) for name, ops in counter.get_flop_counts().items() if "." not in name and "Vision" in name)


def decision_flops(policy: FlowPolicy, obs: Observation, actor) -> dict[str, int]:
    """The floating-point operations of one decision (matmuls, convolutions, attention: what sets a GPU's work), the
    encode's and its vision tower's apart, and the ATen ops the encode dispatches, counted on the eager path. FLOPs
    depend on the shapes only, so a CPU run counts what a GPU does, and flops / seconds is the throughput a path reaches."""
    from common.rollout import decide

    encodes: list[tuple[FlopCounterMode, OpCounter]] = []

    def counted_encode(observation: Observation, encode: Callable = policy.encode) -> Any:
        with flop_counter() as flops, OpCounter() as ops:
            features = encode(observation)
        encodes.append((flops, ops))
        return features

    policy.encode = counted_encode
    try:
        with torch.no_grad(), actor.precision(), flop_counter() as whole:
            decide(policy, obs, deterministic=False, generator=torch.Generator(device=actor.device).manual_seed(0))
    finally:
        del policy.encode  # the method again
    ((encoded, encode_ops),) = encodes
    return {"flops": whole.get_total_flops(), "encode_flops": encoded.get_total_flops(), "vision_flops": vision_flops(encoded),
            "encode_aten_ops": encode_ops.ops}  # fmt: skip


def decision_latency(actor, batch_sizes: list[int], repeats: int, clock: Clock, profile: bool, compiled: bool,
                     compiled_vision: bool, fused: bool) -> dict[str, Any]:  # fmt: skip
    """Median seconds of one chunk decision (encode + K denoising steps + critic) on random frames and the real tokenizer,
    eager and (on a GPU) as a CUDA graph replay (common.decision_graph), and the host's ops and launches per decision
    (profile: also the profiler's tables of the first batch size's decisions). compiled: each path again with its
    denoising steps compiled (common.flow.compile_steps; `<path>_compiled`); compiled_vision: those paths, and each path
    again with its vision tower compiled too (VLAFlowPolicy.compile_vision; `<path>_compiled_vision`); with the kernels
    the compiler generated for the path (a `_compiled_vision` path's: the vision tower's, its steps being compiled
    already); fused: every path again with the attention through one fused kernel (the policy's fuse_attention;
    `<path>_fused`). Every path's outputs are set against the eager path's on the same noise."""
    from torch._inductor import metrics as inductor_metrics

    from common.decision_graph import DecisionGraph
    from common.flow import compile_steps

    policy = actor.policy
    size, cameras = policy.config.image_size, len(policy.config.cameras)
    autocast = torch.bfloat16 if actor.config.actors.speed.precision == "bfloat16" else None
    paths = ("eager", "graph") if actor.device.type == "cuda" else ("eager",)
    kept, kept_step, kept_vision, figures = policy.decision_graph, policy.compiled_step, policy.compiled_vision, {}
    kept_fused = fused and policy.attention_fused
    suffixes = ("", "_compiled", "_compiled_vision")[: 3 if compiled_vision else 2 if compiled else 1]
    suffixes += tuple(f"{suffix}_fused" for suffix in suffixes) if fused else ()
    paths = tuple(f"{path}{suffix}" for path in paths for suffix in suffixes)
    if compiled or compiled_vision:
        compile_steps(policy, "actors.speed.compile_steps")
    if compiled_vision:
        policy.compile_vision("actors.speed.compile_vision")
    compiled_step, vision = policy.compiled_step, policy.compiled_vision
    rng = np.random.default_rng(0)
    try:
        for batch in batch_sizes:
            tokens, mask = policy.tokenize([actor.vec_env.envs[0].instruction] * batch)
            obs = Observation(rng.normal(size=(batch, policy.config.obs_dim)).astype(np.float32),
                              rng.integers(0, 256, (batch, cameras, size, size, 3), dtype=np.uint8), tokens, mask)  # fmt: skip
            for path in paths:
                policy.decision_graph = DecisionGraph(policy, batch, autocast) if path.startswith("graph") else None
                policy.compiled_step = compiled_step if "_compiled" in path else None
                policy.compiled_vision = vision if "_compiled_vision" in path else None
                if fused:
                    policy.fuse_attention("_fused" in path)
                inductor_metrics.reset()
                try:
                    times, counted = timed_decisions(actor, obs, repeats, clock)
                except Exception as exc:  # noqa: BLE001 - a graph that cannot be captured: the actor samples eagerly
                    if path == "eager":
                        raise
                    traceback.print_exc()
                    figures[f"{path}_batch{batch}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    kept = None if path == "graph" else kept  # a graph the actor cannot capture: it samples eagerly
                    continue
                seconds = figures[f"{path}_batch{batch}_seconds"] = statistics.median(times[1:])
                if path == "eager":  # the same arithmetic on every path
                    figures.update({f"batch{batch}_{name}": count for name, count in decision_flops(policy, obs, actor).items()})
                else:
                    figures[f"{path}_batch{batch}_first_call_seconds"] = times[0]  # the capture, the compile
                    figures.update(against_eager(actor, obs, f"{path}_vs_eager_batch{batch}"))
                if "_compiled" in path:
                    figures[f"{path}_batch{batch}_generated_kernels"] = inductor_metrics.generated_kernel_count
                figures[f"{path}_batch{batch}_tflop_per_second"] = figures[f"batch{batch}_flops"] / seconds / 1e12
                figures.update({f"{path}_batch{batch}_{name}": count for name, count in counted.counts().items()})
                if profile and batch == batch_sizes[0] and isinstance(counted, torch.profiler.profile):
                    for clock_name, sort_by in (("CPU", "self_cpu_time_total"), ("GPU", "self_device_time_total")):
                        print(f"[smolvla_gpu] one {path} decision for {batch} envs, by {clock_name} time:", flush=True)
                        print(counted.key_averages().table(sort_by=sort_by, row_limit=20), flush=True)
            pairs = [("graph", "eager"), ("eager_compiled", "eager"), ("graph_compiled", "graph"),
                     ("eager_compiled_vision", "eager_compiled"), ("graph_compiled_vision", "graph_compiled")]  # fmt: skip
            for faster, slower in [*pairs, *((f"{path}_fused", path) for path in paths if not path.endswith("_fused"))]:
                fast, slow = figures.get(f"{faster}_batch{batch}_seconds"), figures.get(f"{slower}_batch{batch}_seconds")
                if fast is not None and slow is not None:
                    figures[f"{faster}_speedup_batch{batch}"] = slow / fast
    finally:
        policy.decision_graph, policy.compiled_step, policy.compiled_vision = kept, kept_step, kept_vision
        if fused:
            policy.fuse_attention(kept_fused)
    return figures


def timed_decisions(actor, obs: Observation, repeats: int, clock: Clock) -> tuple[list[float], LaunchProfile | OpCounter]:
    """Seconds of `repeats` + 1 decisions by the actor's policy as it is set (the first warms up kernels and allocator,
    compiles and captures), and the host work of one more."""
    from common.rollout import decide

    policy, times = actor.policy, []
    with torch.no_grad(), actor.precision():
        for _ in range(repeats + 1):
            start = clock.now()
            decide(policy, obs, deterministic=False, generator=torch.Generator(device=actor.device).manual_seed(0))
            times.append(clock.now() - start)
        with host_work_counter(actor.device) as counted:
            decide(policy, obs, deterministic=False, generator=torch.Generator(device=actor.device).manual_seed(0))
    return times, counted


def against_eager(actor, obs: Observation, prefix: str) -> dict[str, float]:
    """Max abs difference of a decision's chain and per-element log-prob, by the actor's policy as it is set (a
    graph, a compiled step or vision tower, fused attention) against the plain eager path on the same noise."""
    from common.rollout import decision_tensors

    policy, device = actor.policy, actor.device
    graph, step, vision = policy.decision_graph, policy.compiled_step, policy.compiled_vision
    fused = getattr(policy, "attention_fused", False)
    with torch.no_grad(), actor.precision():
        if graph is not None:
            fast = graph.decide(obs, deterministic=False, generator=torch.Generator(device=device).manual_seed(1))
            noise = graph.noise.clone()
        else:
            shape = (policy.num_steps + 1, obs.state.shape[0], policy.chunk_size, policy.action_dim)
            noise = torch.randn(shape, generator=torch.Generator(device=device).manual_seed(1), device=device)
            outputs = decision_tensors(policy, obs.to_torch(device), deterministic=False, noise=noise)
            fast = {name: value.float().cpu().numpy() for name, value in outputs.items()}
        policy.decision_graph = policy.compiled_step = policy.compiled_vision = None
        if fused:
            policy.fuse_attention(False)
        try:
            eager = decision_tensors(policy, obs.to_torch(device), deterministic=False, noise=noise)
        finally:
            policy.decision_graph, policy.compiled_step, policy.compiled_vision = graph, step, vision
            if fused:
                policy.fuse_attention(True)
    return {f"{prefix}_max_abs_{name}": float(np.abs(fast[name] - eager[name].float().cpu().numpy()).max())
            for name in ("chain", "log_prob_per_element")}  # fmt: skip


def compiles(config: RunConfig) -> bool:
    """Whether the learner of `config` runs anything through torch.compile."""
    return config.learner.speed.compile_steps or config.learner.speed.compile_vision


def rollout_figures(batch, seconds: float) -> dict[str, Any]:
    return {
        "seconds": seconds,
        # what crosses the object store from an actor to the learner
        "record_bytes_per_decision": sum(array.nbytes for array in record_arrays(batch).values()) / (batch.num_decisions * batch.num_envs),
        "env_steps": batch.env_steps,
        "env_steps_per_second": batch.env_steps / seconds,
        "policy_cpu_seconds": batch.policy_cpu_seconds,
        "env_cpu_seconds": batch.env_cpu_seconds,
        "actor_precision": batch.actor_precision,
    }


def measure(args: argparse.Namespace, results: dict[str, Any], device: torch.device) -> None:
    """Every stage into `results`, on `device`."""
    from actors.rollout_actor import RolloutActor
    from learner.update.learner import Learner
    from learner.update.micro_batches import MicroBatchPlan

    cuda, clock = device.type == "cuda", Clock(device)
    # stdout carries the figures only: what lerobot and the stages print goes to stderr.
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp, contextlib.redirect_stdout(sys.stderr):
        work = Path(tmp)
        built: dict[str, Any] = {}

        def build() -> dict[str, Any]:
            start = time.perf_counter()
            config, checkpoint, counts = write_inputs(work, args.size, args.set, args.recipe)
            if not cuda:  # the recipe asks for GPUs, and sizes micro-batches by a GPU's allocator; the tiny path runs where it is
                config.actors.num_gpus = config.learner.num_gpus = 0.0
                config.learner.speed.micro_batch_memory_gib = 0.0
            # The update measured is one that trains the actor, as every update after the recipe's first few does: a
            # critic warm-up update scores the chains but takes no gradient through them.
            config.algorithm.critic_warmup_iters = 0
            built.update(config=config, checkpoint=checkpoint)
            return {**counts, "seconds": time.perf_counter() - start}

        if not run_stage(results, "build", build, device):
            return
        config, checkpoint = built["config"], built["checkpoint"]
        state: dict[str, Any] = {}

        def start_actor() -> dict[str, Any]:
            start = clock.now()
            state["actor"] = RolloutActor(config, 0, checkpoint)
            return {"seconds": clock.now() - start, "device": str(state["actor"].device), "precision": config.actors.speed.precision}

        def latency() -> dict[str, Any]:
            batches = [int(b) for b in args.batch_sizes.split(",")]
            return decision_latency(state["actor"], batches, args.repeats, clock, args.profile, args.compile_steps, args.compile_vision,
                                    args.fused_attention)  # fmt: skip

        def sampled_by(actor: RolloutActor) -> tuple[list[RolloutBatch], dict[str, Any]]:
            """`args.rollouts` rollouts of version 0 by `actor`, and their median figures."""
            batches, per_rollout = [], []
            for index in range(args.rollouts):
                start = clock.now()
                batches.append(actor.sample(None, iteration=index))  # iteration index: each rollout its own seed
                per_rollout.append(rollout_figures(batches[-1], clock.now() - start))
            return batches, {"rollouts": len(batches), "decisions_per_rollout": batches[0].num_decisions * batches[0].num_envs,
                             **{key: statistics.median(r[key] for r in per_rollout) for key in ("seconds", "env_steps_per_second",
                                "policy_cpu_seconds", "env_cpu_seconds", "record_bytes_per_decision")},
                             "actor_precision": per_rollout[0]["actor_precision"]}  # fmt: skip

        def sample_version_0() -> dict[str, Any]:
            state["batches"], figures = sampled_by(state["actor"])
            return figures

        def start_learner() -> dict[str, Any]:
            start = clock.now()
            policy = FlowPolicy.from_pretrained(checkpoint, **config.policy.sampling_overrides())
            state["learner"] = Learner(config, policy.to(device))
            state["learner"].broadcast()  # version 0, as the driver publishes it before the first rollout
            return {"seconds": clock.now() - start}

        def version_0_rollouts(batches: list[RolloutBatch] | None = None) -> RolloutBatch:
            """What every update and scoring pass here learns from: the sampled rollouts (or `batches`, a variant's actor's),
            --rollout-repeats times over."""
            return RolloutBatch.concat((batches or state["batches"]) * args.rollout_repeats)

        def prepare(rows: int | None) -> Callable[[], dict[str, Any]]:
            """The learner's scoring pass alone (encode, old log-probs, values, GAE), encoding `rows` observations at a
            time (None: the update's largest micro-batch, by the learner's plan)."""

            def stage() -> dict[str, Any]:
                learner, batch = state["learner"], version_0_rollouts()
                plan = learner.plan
                if rows is not None:
                    learner.plan = MicroBatchPlan(dataclasses.replace(learner.cfg, minibatch_size=rows, grad_accum=1))
                try:
                    start = clock.now()
                    learner.prepare(batch)
                    return {"seconds": clock.now() - start, "rows_per_encode": learner.plan.rows(batch.num_decisions * batch.num_envs)}
                finally:
                    learner.plan = plan

            return stage

        def update(batches: list[RolloutBatch] | None = None) -> dict[str, Any]:
            """The learner's update, with the seconds of its own scoring pass (Learner.prepare) apart from its steps. An
            update that ran out of GPU memory and was made again in smaller micro-batches (learner.faults.split_on_out_of_memory)
            counts every try in its seconds, and reports the split it kept (faults/grad_accum) and its last scoring pass."""
            batch, learner = version_0_rollouts(batches), state["learner"]
            scoring: list[float] = []
            # On CPU, the host's ops (the profiler counts decisions only) and the FLOPs: counting costs host time on a GPU.
            # Not the FLOPs of a compiling learner: torch.compile runs eagerly under the FLOP counter, and the shapes are the same.
            ops = None if cuda else OpCounter()
            flops, scoring_flops = (None, None) if cuda or compiles(learner.config) else (flop_counter(), flop_counter())
            saved = None if compiles(learner.config) else SavedForBackward()  # a compiled backward keeps its own

            def timed_prepare(rollout: RolloutBatch, prepare: Callable = learner.prepare) -> Any:
                start = clock.now()
                with scoring_flops or contextlib.nullcontext():
                    prepared = prepare(rollout)
                scoring.append(clock.now() - start)
                return prepared

            learner.prepare = timed_prepare
            try:
                with (warnings.catch_warnings(record=True) as caught, ops or contextlib.nullcontext(), flops or contextlib.nullcontext(),
                      saved or contextlib.nullcontext()):  # fmt: skip
                    warnings.simplefilter("always", BehaviourGapWarning)
                    start = clock.now()
                    metrics = learner.update(batch)
                    seconds = clock.now() - start
            finally:
                del learner.prepare  # the method again
            keep = ("logprob/behaviour_gap_max", "logprob/precision_gap_max", "ppo/first_minibatch_ratio_dev", "losses/clipfrac",
                    "losses/approx_kl", "ppo/optimizer_steps", "ppo/kl_early_stop", "logprob/per_element", "policy/sigma_mean",
                    "ppo/actor_lr", "faults/grad_accum", "ppo/micro_batch_rows")  # fmt: skip
            return {"seconds": seconds, "scoring_pass_seconds": scoring[-1], "decisions": batch.num_decisions * batch.num_envs,
                    **{k: metrics[k] for k in keep if k in metrics}, **learner.state_bytes(), **({} if ops is None else ops.counts()),
                    **({} if saved is None else {"saved_for_backward_peak_bytes": saved.peak_bytes}),
                    **({} if flops is None else {"flops": flops.get_total_flops(), "scoring_pass_flops": scoring_flops.get_total_flops(),
                                                 "vision_flops": vision_flops(flops)}),
                    "behaviour_gap_warnings": sum(issubclass(w.category, BehaviourGapWarning) for w in caught)}  # fmt: skip

        def publish_and_load() -> dict[str, Any]:
            start = clock.now()
            payload = state["learner"].broadcast()
            published = clock.now()
            state["actor"].load_weights(payload)
            loaded = clock.now()
            start_sample = clock.now()
            batch = state["actor"].sample(payload, iteration=args.rollouts)
            sampled = clock.now()
            prepared = state["learner"].prepare(batch)  # scores the version-1 rollout with the learner's float32 weights
            return {"publish_seconds": published - start, "load_seconds": loaded - published, "version": payload.version,
                    "behaviour_gap_max": prepared.metrics["logprob/behaviour_gap_max"],
                    **{f"rollout_{k}": v for k, v in rollout_figures(batch, sampled - start_sample).items()}}  # fmt: skip

        def fresh_learner(variant: RunConfig, ranks: RankGroup | None = None) -> Learner:
            """A learner of `variant` from the checkpoint (alone, or as `ranks`), version 0 published, in state."""
            # The previous learner goes first: its weights and optimiser would count in this peak.
            state.pop("learner", None)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            policy = FlowPolicy.from_pretrained(checkpoint, **config.policy.sampling_overrides())
            state["learner"] = Learner(variant, policy.to(device), ranks=ranks)
            state["learner"].broadcast()
            return state["learner"]

        def update_variant(overrides: str) -> Callable[[], dict[str, Any]]:
            """A fresh learner from the same checkpoint with config fields overridden (e.g.
            "algorithm.grad_accum=1,learner.speed.precision=bfloat16"), its update on the same version-0 rollouts; where
            the overrides name an actors field (e.g. "actors.speed.send_image_embeddings=true"), on the rollouts of the same
            seeds sampled by a fresh actor of the variant (its figures as `sample_*`)."""

            def stage() -> dict[str, Any]:
                changes: dict[str, Any] = {}
                for item in overrides.split(","):
                    apply_override(changes, item)
                variant = from_dict(RunConfig, changes, base=config)
                variant.validate()
                batches, sampled = None, {}
                if "actors" in changes:
                    batches, figures = sampled_by(RolloutActor(variant, 0, checkpoint))
                    sampled = {f"sample_{key}": value for key, value in figures.items()}
                first_update = {}
                if compiles(variant):
                    # The compiler's first calls, on an update of their own: the timed update's learner, another policy
                    # of the same structure, runs the graphs they built (graphs_compiled counts any it adds).
                    start = clock.now()
                    fresh_learner(variant).update(version_0_rollouts(batches))
                    first_update = {"first_update_seconds": clock.now() - start}
                graphs = counters["stats"]["unique_graphs"]
                fresh_learner(variant)
                figures = update(batches)
                return {**figures, **first_update, **sampled, "graphs_compiled": counters["stats"]["unique_graphs"] - graphs}

            return stage

        def group_of_one() -> dict[str, Any]:
            """The recipe's update by a learner alone and by the group's code path with one rank, taking turns."""
            ranks = join_learner_group(free_address("127.0.0.1"), 0, 1, device)
            try:
                seconds: dict[str, list[float]] = {"alone": [], "group": []}
                trained: dict[str, list[Tensor]] = {}
                for _ in range(args.group_of_one):
                    for name in ("alone", "group"):
                        learner = fresh_learner(config, ranks if name == "group" else None)
                        figures = update()
                        seconds[name].append(figures["seconds"])
                        trained[name] = [p.detach().cpu() for p in learner.actor_params + learner.critic_params]
            finally:
                dist.destroy_process_group()
            alone, group = statistics.median(seconds["alone"]), statistics.median(seconds["group"])
            difference = max((a - b).abs().max().item() for a, b in zip(trained["alone"], trained["group"], strict=True))
            return {"alone_seconds": alone, "group_seconds": group, "over_alone": ratio(group, alone), "turns": args.group_of_one,
                    "max_abs_weight_difference": difference, "ppo/first_minibatch_ratio_dev": figures.get("ppo/first_minibatch_ratio_dev"),
                    **{k: figures[k] for k in ("parameter_bytes", "gradient_bytes", "optimizer_bytes")}}  # fmt: skip

        skipped = args.skip
        if run_stage(results, "actor_start", start_actor, device):
            if "decision_latency" not in skipped:
                run_stage(results, "decision_latency", latency, device)
            sampled = run_stage(results, "sample_v0", sample_version_0, device)
            if run_stage(results, "learner_start", start_learner, device) and sampled:
                if "prepare" not in skipped:
                    run_stage(results, "prepare", prepare(None), device)
                if args.prepare_whole_batch:
                    run_stage(results, "prepare_whole_batch", prepare(sum(b.num_decisions * b.num_envs for b in state["batches"])), device)
                if run_stage(results, "update", update, device) and "publish_load_sample_v1" not in skipped:
                    run_stage(results, "publish_load_sample_v1", publish_and_load, device)
                for overrides in filter(None, args.update_variants.split(";")):
                    run_stage(results, f"update[{overrides}]", update_variant(overrides), device)
                if args.group_of_one:
                    run_stage(results, "group_of_one", group_of_one, device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("full", "tiny"), default="full")
    parser.add_argument("--recipe", type=Path, default=RECIPE, help="the run config measured (or configs/pi0_pick.yaml, pi05_pick.yaml)")
    parser.add_argument("--rollout-repeats", type=int, default=1,
                        help="the update trains on the sampled rollouts this many times over (its cost is the same)")  # fmt: skip
    parser.add_argument("--rollouts", type=int, default=4, help="rollouts of version 0 for the update (the recipe has 16 actors)")
    parser.add_argument("--batch-sizes", default="1,4,16", help="decision latency at these numbers of envs per call")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--prepare-whole-batch",
        action="store_true",
        help="also time the scoring pass encoding the whole batch at once (the learner before it encoded by micro-batch)",
    )
    parser.add_argument("--update-variants", default="", metavar="FIELD=VALUE[,...][;...]",
                        help="then the update again, by a fresh learner per ;-separated set of learner overrides")  # fmt: skip
    parser.add_argument("--group-of-one", type=int, default=0, metavar="N",
                        help="then the recipe's update N times alone and N times on the learner group's path with one rank")  # fmt: skip
    parser.add_argument(
        "--skip",
        default="",
        metavar="STAGE[,STAGE]",
        help=f"leave out these optional stages: {', '.join(OPTIONAL_STAGES)} (the update times its own scoring pass)",
    )
    parser.add_argument("--profile", action="store_true",
                        help="print the profiler tables (by CPU and by GPU time) of one eager and one graphed decision")  # fmt: skip
    parser.add_argument("--compile-steps", action="store_true",
                        help="also time each decision path with its denoising steps compiled (actors.speed.compile_steps)")  # fmt: skip
    parser.add_argument("--compile-vision", action="store_true",
                        help="as --compile-steps, and each decision path again with its vision tower compiled too "
                             "(actors.speed.compile_vision)")  # fmt: skip
    parser.add_argument("--fused-attention", action="store_true",
                        help="also time each decision path with the VLA's attention through one fused kernel "
                             "(actors.speed.fused_attention)")  # fmt: skip
    parser.add_argument("--work-dir", default=None, help="where the backbone, stand-in and checkpoint are written (a temporary dir)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="run-config override (as learner.main)")
    args = parser.parse_args(argv)
    if args.group_of_one < 0:
        parser.error(f"--group-of-one {args.group_of_one}: a number of turns, 0 or more")
    args.skip = set(filter(None, args.skip.split(",")))
    unknown = args.skip - set(OPTIONAL_STAGES)
    if unknown:
        parser.error(f"--skip: no optional stage named {', '.join(sorted(unknown))} (optional stages: {', '.join(OPTIONAL_STAGES)})")

    results: dict[str, Any] = {"size": args.size, "torch": torch.__version__}
    cuda = torch.cuda.is_available() and args.size == "full"
    device = torch.device("cuda" if cuda else "cpu")
    results["device"] = torch.cuda.get_device_name(0) if cuda else "cpu"
    if args.size == "full" and not cuda:
        print("[smolvla_gpu] no GPU: the full-size model runs on CPU (tens of seconds per chunk decision)", file=sys.stderr, flush=True)
    measure(args, results, device)
    emit(results)
    return 0 if not any(isinstance(v, dict) and "error" in v for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
