"""The update's plan of micro-batches: how many forward and backward passes each minibatch is split into.

It starts at algorithm.grad_accum and is the learner's own state from then on, never written back into the run's
config: a GPU that runs out of memory in an update doubles it (learner.faults.split_on_out_of_memory), and
learner.speed.micro_batch_memory_gib sizes it once, from the allocator's readings around the first micro-batch that trains
the actor.
"""

from __future__ import annotations

import contextlib
import gc
import math
import warnings
from collections.abc import Iterator

import torch
from torch import Tensor

from common.config import AlgorithmConfig
from common.diagnostics import MicroBatchSplitWarning


def micro_batch_rows(cfg: AlgorithmConfig, decisions: int, grad_accum: int | None = None) -> int:
    """The most decisions one forward pass of an update over `decisions` holds: the largest minibatch's largest
    micro-batch, with `grad_accum` micro-batches per minibatch (default: the configured ones)."""
    return -(-cfg.minibatch_sizes(decisions)[0] // (cfg.grad_accum if grad_accum is None else grad_accum))


def micro_batches_within(budget: float, allocated: float, per_row: float, rows: int) -> int:
    """The fewest micro-batches a minibatch of `rows` decisions splits into (as tensor_split does: at most ceil(rows /
    count) decisions each) for `allocated` bytes plus `per_row` bytes per decision of the largest to stay within
    `budget`; `rows`, one decision each, where none does."""
    if per_row <= 0:
        return 1 if allocated <= budget else rows
    fit = math.floor((budget - allocated) / per_row)
    return rows if fit < 1 else min(rows, -(-rows // fit))


class AllocatorMemory:
    """The bytes the CUDA allocator holds on a device, now and at its peak: what micro-batch sizing reads
    (learner.speed.micro_batch_memory_gib). The peak is never reset here, so a reading taken around a whole update stands;
    a peak set earlier and higher makes the sizing's estimate an upper bound."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)


class MicroBatchPlan:
    """grad_accum micro-batches per minibatch (the last ones one decision smaller where they do not divide it)."""

    def __init__(self, cfg: AlgorithmConfig, memory_gib: float = 0.0, memory: AllocatorMemory | None = None):
        self.cfg, self.grad_accum = cfg, cfg.grad_accum
        self.memory_gib, self.memory = memory_gib, memory
        self.sized = not memory_gib  # sized once, at the first step that trains the actor
        self.out_of_memory_splits = 0

    def rows(self, decisions: int) -> int:
        """The most decisions one forward pass of an update over `decisions` holds."""
        return micro_batch_rows(self.cfg, decisions, self.grad_accum)

    def split(self, minibatch: Tensor) -> tuple[Tensor, ...]:
        """The micro-batches of a minibatch's rows (none for none: a learner rank may hold no row of a minibatch)."""
        return minibatch.tensor_split(min(self.grad_accum, len(minibatch))) if len(minibatch) else ()

    @contextlib.contextmanager
    def sizing(self, micro_batch: int, rows: int, minibatch_rows: int, train_actor: bool) -> Iterator[None]:
        """Around micro-batch `micro_batch` of a step (`rows` decisions): while the plan is still to size, the allocator
        read before the first micro-batch that trains the actor and its peak after, which sizes every minibatch of up to
        `minibatch_rows` from the next step on."""
        measured = train_actor and not self.sized and micro_batch == 0
        allocated = self.memory.allocated() if measured else 0
        yield
        if measured:
            self.size_from(allocated, rows, minibatch_rows)

    def size_from(self, allocated: int, rows: int, minibatch_rows: int) -> None:
        """The split of every minibatch from the next one on, estimated from the micro-batch of `rows` decisions just run
        (`allocated` bytes when it began, the allocator's peak after its backward pass)."""
        per_row = (self.memory.peak() - allocated) / rows
        budget = self.memory_gib * 2**30
        self.grad_accum = micro_batches_within(budget, allocated, per_row, minibatch_rows)
        self.sized = True
        if allocated + per_row > budget:
            warnings.warn(
                f"learner.speed.micro_batch_memory_gib={self.memory_gib}: one decision alone needs about "
                f"{(allocated + per_row) / 2**30:.2f} GiB ({allocated / 2**30:.2f} GiB allocated before the micro-batch); the update "
                "goes on with one decision per micro-batch",
                MicroBatchSplitWarning,
                stacklevel=3,
            )

    def split_after_out_of_memory(self, decisions: int, error: str, iteration: int) -> None:
        """Twice the micro-batches per minibatch from now on, after a GPU ran out of memory on an update of `decisions`."""
        rows, accum = self.rows(decisions), self.grad_accum
        self.grad_accum = min(2 * accum, self.cfg.minibatch_sizes(decisions)[0])
        self.out_of_memory_splits += 1
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        warnings.warn(
            f"iteration {iteration}: out of GPU memory with micro-batches of {rows} decisions ({error}); the update runs again from "
            f"its start with micro-batches of <= {self.rows(decisions)} (algorithm.grad_accum {accum} -> {self.grad_accum}, kept "
            "from now on)",
            MicroBatchSplitWarning,
            stacklevel=3,
        )
