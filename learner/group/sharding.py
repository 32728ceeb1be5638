"""How a learner holds its policy (learner.sharding): whole on every rank, or split over a learner group's ranks with torch's
FSDP2 (`fully_shard`), each rank holding 1/N of every parameter, of its gradient and of its Adam state.

Which modules are wrapped: every module that owns parameters itself (a Linear, an Embedding, a norm, a convolution), each
its own FSDP unit. lerobot's VLAs run their transformer layers by calling a layer's projections, norms and MLP one by one
(the VLM's and the action expert's streams share each attention), never the layer's own forward, so a unit per layer
would never see its hooks fire; a unit per parameter owner gathers exactly the weights each call reads, and the memory of
parameters, gradients and optimiser state falls as 1/N whatever the architecture.

FSDP's gathers and gradient reductions are collectives: every rank must run the same forward and backward passes in
the same order. Two places would not:
- scoring (no gradients) runs as many passes as a rank holds chunks of rollouts, so the policy is gathered whole for it
  (`FullySharded.whole`): no collective inside, a peak of the whole parameters (not their gradients or Adam state);
- in the update a rank runs as many micro-batches as its share of a minibatch needs, so every rank runs the largest
  count, a rank with fewer running zero-weight passes over one of its rows (`FullySharded.padding_passes`),
  and the checks that would stop one rank mid-minibatch wait for its end (`FullySharded.checks`).
"""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from learner.group.ranks import SingleRank


def local(tensor: Tensor) -> Tensor:
    """This rank's part of `tensor` (a shard, or the whole of an unsharded tensor)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_bytes(tensors: Iterator[Tensor] | Sequence[Tensor]) -> int:
    return sum(local(t).nbytes for t in tensors)


def peak_bytes(device: torch.device) -> int:
    """The process's peak memory so far: the CUDA allocator's on a GPU, the resident set's on a CPU (Linux: KiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Deferred:
    """A check's failure held back until `raise_first`, where a rank must not stop alone between collectives."""

    def __init__(self, defer: bool):
        self.defer, self.failure = defer, None

    def __enter__(self) -> Deferred:
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, traceback: Any) -> bool:
        if error is None or not self.defer:
            return False
        self.failure = self.failure or error
        return True

    def raise_first(self) -> None:
        if self.failure is not None:
            raise self.failure


class Unsharded:
    """Every rank holds the whole policy; a group sums its gradients with one all-reduce per optimiser step."""

    sharded = False

    def __init__(self, ranks: SingleRank):
        self.ranks = ranks

    def whole(self) -> contextlib.AbstractContextManager:
        """The policy whole for the duration: a pass of any rank may run alone."""
        return contextlib.nullcontext()

    def rows_to_hold(self, kept: Tensor) -> Tensor:
        """The rows of its prepared rollout a rank holds through the update, given the `kept` ones that enter the loss."""
        return kept

    def padding_passes(self, micro_batches: int) -> int:
        """The zero-weight passes this rank runs after its `micro_batches` of a minibatch: none where a pass may run alone."""
        return 0

    def checks(self) -> Deferred:
        return Deferred(defer=False)

    def reduce_gradients(self, params: Sequence[nn.Parameter]) -> None:
        self.ranks.sum_gradients(params)

    def full(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """`tensors` whole (gathered from every rank's shards where sharded)."""
        return tensors

    def full_optimizer_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """An optimiser's state_dict as a learner alone holds it."""
        return state

    def optimizer_state_here(self, state: dict[str, Any], params: Sequence[nn.Parameter]) -> dict[str, Any]:
        """A learner alone's optimiser state_dict (`params`: the optimiser's, in its order) as this rank holds it."""
        return state


class FullySharded(Unsharded):
    """Each parameter, gradient and Adam state split over the group's ranks (torch FSDP2, one unit per parameter owner)."""

    sharded = True

    def __init__(self, ranks: SingleRank, policy: nn.Module):
        super().__init__(ranks)
        mesh = init_device_mesh(policy.obs_device.type, (ranks.size,))
        owners = [module for module in policy.modules() if next(module.parameters(recurse=False), None) is not None]
        self.units: list[FSDPModule] = []
        for module in owners:
            unit = fully_shard(module, mesh=mesh)
            # The loss each rank backpropagates is already its share of the minibatch's mean: the gradients are summed,
            # with a plain sum (what gloo offers) rather than a scaled one.
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
            self.units.append(unit)

    @contextlib.contextmanager
    def whole(self) -> Iterator[None]:
        for unit in self.units:
            unit.set_reshard_after_forward(False)
            unit.unshard()
        try:
            yield
        finally:
            for unit in self.units:
                unit.reshard()
                unit.set_reshard_after_forward(True)

    def rows_to_hold(self, kept: Tensor) -> Tensor:
        # Where none is kept, one row for the padding passes (no minibatch draws it: rows_here never points to it).
        return kept if len(kept) else torch.zeros(1, dtype=torch.int64, device=kept.device)

    def padding_passes(self, micro_batches: int) -> int:
        return int(self.ranks.max(micro_batches)) - micro_batches

    def checks(self) -> Deferred:
        return Deferred(defer=True)

    def reduce_gradients(self, params: Sequence[nn.Parameter]) -> None:
        pass  # reduced and scattered by FSDP in the backward passes

    def full(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        return {name: t.full_tensor() if isinstance(t, DTensor) else t for name, t in tensors.items()}

    def full_optimizer_state(self, state: dict[str, Any]) -> dict[str, Any]:
        return {**state, "state": {index: self.full(values) for index, values in state["state"].items()}}

    def optimizer_state_here(self, state: dict[str, Any], params: Sequence[nn.Parameter]) -> dict[str, Any]:
        def shard_like(param: nn.Parameter, value: Tensor) -> Tensor:
            if not isinstance(param, DTensor) or value.shape != param.shape:  # Adam's step count
                return value
            # Every rank read the same checkpoint: each keeps its own shard, without a transfer.
            return distribute_tensor(value.to(param.device_mesh.device_type), param.device_mesh, param.placements, src_data_rank=None)

        return {
            **state,
            "state": {
                index: {key: shard_like(params[index], value) for key, value in values.items()} for index, values in state["state"].items()
            },
        }


def hold(policy: nn.Module, ranks: SingleRank, sharding: str) -> Unsharded:
    """How this rank holds `policy` (learner.sharding); "fsdp" shards it in place over a group of ranks (a learner alone,
    such as one a tool builds from a group's config, holds it whole)."""
    return FullySharded(ranks, policy) if sharding == "fsdp" and ranks.size > 1 else Unsharded(ranks)
