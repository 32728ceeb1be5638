"""Whole chunk decisions replayed as one CUDA graph: encode, the K denoising steps, the critic and the chain's
log-probs, captured once per actor and batch size and replayed for every decision.

Why: a VLA decision is thousands of small kernels (bench/smolvla_gpu.py counts them), so on a GPU the CPU that
launches them, not the GPU, sets its time. A graph replay launches them all at once. What changes against the eager
path (common.rollout.decide without a graph):
  - the chain's noise is drawn in one call, (K+1, B, H, A) standard normals, into a fixed buffer the graph reads
    (common.flow.sample_chain's `noise`); deterministic decisions read zeros there, which gives the eager path's
    deterministic chain (no injected noise, a_0 = 0 or drawn: policy.eval_init_noise_std). A run with graphs therefore
    draws other noise than one
    without: each is reproducible per seed, and the two are not bit-identical;
  - batches smaller than the graph's (evaluation ends episodes one by one) fill the rest of the fixed inputs with
    the rows of earlier calls; rows never mix, so the real rows are what they would be alone;
  - the policy's capture_context() (a backend whose library synchronises with the host on the way, as lerobot's
    SmolVLA does) is entered while warming up and capturing, and constant tensors that the library builds from
    Python data are uploaded once, in the warm-up, and reused by the capture (`reused_uploads`);
  - host work that no capture can hold (pi0.5 writes the state into its text prompt) is done before each replay by
    the policy's graph_observation(), whose result the fixed inputs hold.
The graph's outputs are packed into one float32 buffer, so a decision costs one copy back to the host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor

from common.observation import Observation
from common.policy import FlowPolicy
from common.rollout import decision_tensors

# Warm-up runs before the capture (on a side stream, as CUDA graph capture requires): kernels are selected,
# workspaces allocated and the library's constant uploads recorded.
WARMUP_RUNS = 2


TORCH_TENSOR = torch.tensor
# The open reused_uploads contexts, innermost last: (uploads, capturing, device type).
KEPT_UPLOADS: list[tuple[dict[tuple, Tensor], bool, str]] = []


def tensor_with_kept_uploads(data: Any, *args: Any, dtype: torch.dtype | None = None, device: Any = None, **kwargs: Any) -> Tensor:
    """torch.tensor while a reused_uploads context is open. The same function for every context: a compiled step
    (actors.speed.compile_steps) traced through it is guarded on it, so a step compiled in the warm-up is not compiled again
    in the capture; and what a compiled step uploads is a constant of its graph, made at its compile, so its trace
    takes torch.tensor itself."""
    if torch.compiler.is_compiling():
        return TORCH_TENSOR(data, *args, dtype=dtype, device=device, **kwargs)
    uploads, capturing, device_type = KEPT_UPLOADS[-1]
    if device is None or torch.device(device).type != device_type or isinstance(data, (Tensor, np.ndarray)) or args or kwargs:
        return TORCH_TENSOR(data, *args, dtype=dtype, device=device, **kwargs)
    key = (repr(data), dtype, str(device))
    if key not in uploads:
        if capturing:
            raise RuntimeError(f"host upload of {key[0][:80]} first seen while capturing a decision graph, not in its warm-up")
        uploads[key] = TORCH_TENSOR(data, dtype=dtype, device=device)
    return uploads[key]


@contextlib.contextmanager
def reused_uploads(uploads: dict[tuple, Tensor], capturing: bool, device_type: str = "cuda") -> Iterator[None]:
    """torch.tensor(python data, device=<cuda>) copies from host memory and waits for the copy, which a CUDA graph
    capture forbids; lerobot and transformers build attention-mask patterns and scale factors that way at every call.
    Inside this context each such upload is kept by (data, dtype, device) in `uploads` outside a capture and handed out
    again inside one (tensor_with_kept_uploads). The data are constants of the shapes, so one device copy serves every
    replay; an upload first seen inside a capture depends on something the warm-up did not see, and is refused.
    `device_type`: the device whose uploads are kept (tests use "cpu")."""
    KEPT_UPLOADS.append((uploads, capturing, device_type))
    torch.tensor = tensor_with_kept_uploads
    try:
        yield
    finally:
        KEPT_UPLOADS.pop()
        if not KEPT_UPLOADS:
            torch.tensor = TORCH_TENSOR


class DecisionGraph:
    """Decisions for up to `batch_size` observations of one shape, as CUDA graph replays (the module docstring says
    what differs from the eager path). Captured at the first call, from that call's observations; `autocast_dtype`:
    the autocast the actor samples under (None: none)."""

    def __init__(self, policy: FlowPolicy, batch_size: int, autocast_dtype: torch.dtype | None) -> None:
        device = policy.obs_device
        if device.type != "cuda":
            raise ValueError(f"a decision graph needs the policy on a CUDA device, not {device}")
        self.policy, self.batch_size, self.autocast_dtype = policy, batch_size, autocast_dtype
        self.noise = torch.zeros((policy.num_steps + 1, batch_size, policy.chunk_size, policy.action_dim), device=device)
        self.inputs: Observation | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.packed: Tensor | None = None  # (batch_size, sum of the fields' widths) float32: the graph's output
        self.layout: list[tuple[str, tuple[int, ...]]] = []  # (field, shape of one row) in packed order
        self.uploads: dict[tuple, Tensor] = {}

    def _pack(self) -> Tensor:
        """One eager pass over the fixed inputs and noise, its outputs packed into (batch_size, width) float32."""
        with (
            torch.no_grad(),
            torch.autocast(
                "cuda", dtype=self.autocast_dtype or torch.float32, enabled=self.autocast_dtype is not None, cache_enabled=False
            ),
        ):
            outputs = decision_tensors(self.policy, self.inputs, deterministic=False, noise=self.noise)
        self.layout = [(name, tuple(value.shape[1:])) for name, value in outputs.items()]
        return torch.cat([value.float().reshape(self.batch_size, -1) for value in outputs.values()], dim=1)

    def _capture(self, obs: Observation) -> None:
        """Fixed input buffers holding `obs` (its first row repeated up to batch_size), warm-up, capture."""
        first = obs.to_torch(self.policy.obs_device)
        rows = [0] * self.batch_size
        rows[: obs.batch_shape[0]] = range(obs.batch_shape[0])
        self.inputs = first.index(torch.tensor(rows, device=first.state.device))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), self.policy.capture_context(), reused_uploads(self.uploads, capturing=False):
            for _ in range(WARMUP_RUNS):
                self._pack()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with self.policy.capture_context(), reused_uploads(self.uploads, capturing=True), torch.cuda.graph(graph):
                self.packed = self._pack()
        except RuntimeError as exc:
            raise RuntimeError(
                f"capturing {type(self.policy).__name__}'s decisions as a CUDA graph failed ({exc}); "
                "actors.speed.cuda_graphs: false samples eagerly"
            ) from exc
        self.graph = graph

    def decide(self, obs: Observation, *, deterministic: bool, generator: torch.Generator | None) -> dict[str, np.ndarray]:
        """common.rollout.Decision's fields for numpy observations of at most batch_size rows."""
        obs = self.policy.graph_observation(obs)
        count = obs.batch_shape[0]
        if count > self.batch_size:
            raise ValueError(f"{count} observations for a decision graph of {self.batch_size}")
        if self.graph is None:
            self._capture(obs)
        else:
            for name, array in obs.present().items():
                getattr(self.inputs, name)[:count].copy_(torch.from_numpy(np.asarray(array)))
        if deterministic:
            self.noise.zero_()
            start_std = self.policy.config.eval_init_noise_std
            if start_std > 0:  # the graph scales noise[0] by init_noise_std, which validation holds > 0 here
                self.noise[0].normal_(generator=generator).mul_(start_std / self.policy.config.init_noise_std)
        else:
            self.noise.normal_(generator=generator)
        self.graph.replay()
        packed = self.packed[:count].cpu().numpy()
        fields, start = {}, 0
        for name, shape in self.layout:
            width = int(np.prod(shape, dtype=np.int64))
            fields[name] = packed[:, start : start + width].reshape(count, *shape)
            start += width
        return fields
