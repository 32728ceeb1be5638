"""The learner's ranks: what a data-parallel update shares between the processes of a learner group.

Each rank scores and trains on its own share of an iteration's rollouts; what is a statistic of the whole batch is
made global here: advantage normalisation, which decisions a minibatch draws (one permutation over every rank's
decisions, in the order a single learner would hold them), the gradients (summed: each rank's loss is its share of
the minibatch's mean), the metrics, and every error (one rank's NaN rolls every rank back).

`SingleRank` is the learner alone: each of its collectives is the identity, so a one-rank learner runs the same
operations, bit for bit, as a learner that knows nothing of ranks. `RankGroup` runs them over a torch.distributed
process group (gloo on CPUs, NCCL on GPUs) that each rank joins with `join_learner_group`, under Ray in a run
(learner.runtime.learner_group); nothing here needs Ray.

A collective must be reached by every rank in the same order. Local work that can fail runs inside `together`,
which holds no collective of its own work: on leaving it, every rank learns whether any rank failed, and all raise.
"""

from __future__ import annotations

import contextlib
import math
import random
import socket
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from common.diagnostics import NonFiniteError
from common.rl import EXPLAINED_VARIANCE_MOMENTS, explained_variance_of_moments, normalize

# How long a rank waits in a collective for the others before torch.distributed gives up on the group. The run's own
# deadline on learner calls (learner.faults.call_timeout_s) ends a wedged group first; this only bounds a rank left behind.
COLLECTIVE_TIMEOUT = timedelta(hours=2)
# Per-micro-batch metrics a minibatch reports as their extreme, not their mean.
EXTREMES = {"ratio_min": min, "ratio_max": max}


def pooled(terms: dict[str, list[tuple[float, int]]], means: dict[str, float]) -> dict[str, float]:
    """A minibatch's figures with the explained variance over all its decisions, from every micro-batch's moments of
    the returns and residuals weighted by its rows (a mean of the parts' own explained variances is another number,
    and NaN for a part of one decision); the moments themselves left out."""
    figures = {key: value for key, value in means.items() if key not in EXPLAINED_VARIANCE_MOMENTS}
    if EXPLAINED_VARIANCE_MOMENTS[0] in terms:
        count = sum(rows for _, rows in terms[EXPLAINED_VARIANCE_MOMENTS[0]])
        moments = {key: sum(value * rows for value, rows in terms[key]) / count for key in EXPLAINED_VARIANCE_MOMENTS}
        figures["explained_variance"] = explained_variance_of_moments(moments, count)
    return figures


# The outcome of a rank's local work in `together`, in order of precedence when ranks differ.
OK, NON_FINITE, OUT_OF_MEMORY, FAILED = 0, 1, 2, 3


class PeerRankError(RuntimeError):
    """Another rank of the learner group failed; its own error is what the group reports."""


class SingleRank:
    """The learner alone: rank 0 of 1, every collective the identity."""

    rank, size = 0, 1

    def together(self, where: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def normalize(self, x: Tensor) -> Tensor:
        return normalize(x)

    def std(self, x: Tensor) -> float:
        return x.std().item()

    def any(self, flag: Tensor | bool) -> bool:
        return bool(flag)

    def sum(self, value: float) -> float:
        return value

    def sums(self, values: Sequence[float]) -> list[float]:
        return list(values)

    def max(self, value: float) -> float:
        return value

    def decision_order(self, kept: Tensor) -> tuple[Tensor, int]:
        """(positions (B,) of this rank's kept decisions in the update's order, decisions of the whole update). kept
        (T, N) bool: the decisions of this rank's rollouts that enter the loss."""
        count = int(kept.sum())
        return torch.arange(count, device=kept.device), count

    def sum_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        pass

    def minibatch_means(self, terms: dict[str, list[tuple[float, int]]]) -> dict[str, float]:
        """Each metric's mean over the minibatch's micro-batches (terms: key -> (value, rows) per micro-batch); the
        explained variance over all their decisions (`pooled`) where there are several."""
        means = {key: float(EXTREMES.get(key, np.mean)([value for value, _ in values])) for key, values in terms.items()}
        several = len(terms.get(EXPLAINED_VARIANCE_MOMENTS[0], ())) > 1
        return pooled(terms, means) if several else {key: value for key, value in means.items() if key not in EXPLAINED_VARIANCE_MOMENTS}

    def across_ranks(self, metrics: dict[str, float], decisions: int, counts: Sequence[str] = ()) -> dict[str, float]:
        return metrics

    def gather_to_first(self, item: Any) -> list[Any] | None:
        return [item]

    def broadcast_from_first(self, tensors: Sequence[Tensor]) -> None:
        pass


# Where rank 0's TCP store listens: between the ports Ray gives its workers by default (10002-19999) and the kernel's
# ephemeral range, from which every outgoing connection and every bind to port 0 on the node draws. A port probed free
# there can be taken before rank 0 binds it: under Ray's traffic, often enough to fail a group's start.
RENDEZVOUS_PORTS = (20000, 32768)
EPHEMERAL_PORTS_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_address(ip: str, tries: int = 64) -> str:
    """tcp://IP:PORT of a port free now at `ip` for rank 0's TCP store, drawn at random from RENDEZVOUS_PORTS below the
    node's ephemeral range; a port the kernel picks where none of `tries` draws is free."""
    low, high = RENDEZVOUS_PORTS
    if EPHEMERAL_PORTS_FILE.is_file():
        high = min(high, int(EPHEMERAL_PORTS_FILE.read_text().split()[0]))
    draws = random.SystemRandom()  # the OS's entropy: the run's seeded generators are left as they are
    for _ in range(tries if high > low else 0):
        port = draws.randrange(low, high)
        with socket.socket() as probe:
            try:
                probe.bind((ip, port))
            except OSError:
                continue
            return f"tcp://{ip}:{port}"
    with socket.socket() as probe:
        probe.bind((ip, 0))
        return f"tcp://{ip}:{probe.getsockname()[1]}"


def join_learner_group(address: str, rank: int, size: int, device: torch.device) -> RankGroup:
    """This process as rank `rank` of `size` in the default process group, rendezvousing at `address` (tcp://IP:PORT)."""
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    return RankGroup(rank, size)


class RankGroup(SingleRank):
    """Rank `rank` of `size` in the default torch.distributed process group."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    @contextlib.contextmanager
    def together(self, where: str) -> Iterator[None]:
        """Run local work; then every rank learns the worst outcome of any rank's and raises alike: NonFiniteError
        (the update rolls back everywhere), torch.OutOfMemoryError (every rank splits its micro-batches), or
        PeerRankError on the ranks whose own work succeeded."""
        outcome = torch.tensor([OK, self.rank])
        try:
            yield
        except NonFiniteError:
            outcome[0] = NON_FINITE
            self._worst(outcome)
            raise
        except torch.OutOfMemoryError:
            outcome[0] = OUT_OF_MEMORY
            self._worst(outcome)
            raise
        except Exception:
            outcome[0] = FAILED
            self._worst(outcome)
            raise
        worst, rank = self._worst(outcome)
        if worst == NON_FINITE:
            raise NonFiniteError(f"{where}: learner rank {rank} met a NaN/Inf")
        if worst == OUT_OF_MEMORY:
            raise torch.OutOfMemoryError(f"{where}: learner rank {rank} ran out of memory")
        if worst == FAILED:
            raise PeerRankError(f"{where}: learner rank {rank} failed")

    def _worst(self, outcome: Tensor) -> tuple[int, int]:
        """The worst outcome over the ranks, and the first rank that had it."""
        everyone = [torch.zeros_like(outcome) for _ in range(self.size)]
        dist.all_gather(everyone, outcome)
        worst = max(int(o[0]) for o in everyone)
        return worst, next(int(o[1]) for o in everyone if int(o[0]) == worst)

    def _all_reduce(self, values: Sequence[float], op: dist.ReduceOp) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=op)
        return tensor.tolist()

    def _mean_std(self, x: Tensor) -> tuple[float, float | None]:
        """Mean and unbiased std (as torch.std) over every rank's elements; std None under two elements."""
        count, total = self._all_reduce([x.numel(), float(x.double().sum())], dist.ReduceOp.SUM)
        mean = total / max(count, 1)
        (squares,) = self._all_reduce([float(((x.double() - mean) ** 2).sum())], dist.ReduceOp.SUM)
        return mean, (squares / (count - 1)) ** 0.5 if count >= 2 else None

    def normalize(self, x: Tensor) -> Tensor:
        """Zero mean and unit std over every rank's elements (the unbiased std, as torch.std)."""
        mean, std = self._mean_std(x)
        return x - mean if std is None else (x - mean) / (std + 1e-8)

    def std(self, x: Tensor) -> float:
        """The unbiased std over every rank's elements (NaN under two, as torch.std)."""
        std = self._mean_std(x)[1]
        return math.nan if std is None else std

    def any(self, flag: Tensor | bool) -> bool:
        return self._all_reduce([float(bool(flag))], dist.ReduceOp.MAX)[0] > 0

    def sum(self, value: float) -> float:
        total = self._all_reduce([value], dist.ReduceOp.SUM)[0]
        return int(total) if isinstance(value, int) else total

    def sums(self, values: Sequence[float]) -> list[float]:
        return self._all_reduce(values, dist.ReduceOp.SUM)

    def max(self, value: float) -> float:
        return self._all_reduce([value], dist.ReduceOp.MAX)[0]

    def decision_order(self, kept: Tensor) -> tuple[Tensor, int]:
        """A single learner holds the ranks' rollouts side by side along the env axis, in rank order (each rank's
        rollouts are a consecutive share of the actors'), flattened decision by decision: the kept decisions of this
        rank take their places in that order."""
        masks: list[Any] = [None] * self.size
        dist.all_gather_object(masks, kept.cpu())
        everyone = torch.cat(masks, dim=1)  # (T, every rank's envs)
        position = everyone.flatten().long().cumsum(0).view_as(everyone) - 1
        first_env = sum(mask.shape[1] for mask in masks[: self.rank])
        mine = position[:, first_env : first_env + kept.shape[1]][kept.cpu()]
        return mine.to(kept.device), int(everyone.sum())

    def sum_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Every rank's gradients summed, in one all-reduce over one flat buffer; a parameter this rank's share did
        not reach (no decision of the minibatch) counts as zero."""
        if not params:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            grad = flat[offset : offset + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = grad.clone()
            else:
                p.grad.copy_(grad)
            offset += p.numel()

    def minibatch_means(self, terms: dict[str, list[tuple[float, int]]]) -> dict[str, float]:
        """Each metric's mean over every rank's decisions of the minibatch, the micro-batches weighted by their rows;
        a rank without a decision in it contributes none."""
        everyone: list[Any] = [None] * self.size
        dist.all_gather_object(everyone, terms)
        merged: dict[str, list[tuple[float, int]]] = {}
        for part in everyone:
            for key, values in part.items():
                merged.setdefault(key, []).extend(values)
        means = {key: sum(v * rows for v, rows in values) / sum(rows for _, rows in values) for key, values in merged.items()}
        return pooled(merged, means | {key: EXTREMES[key](v for v, _ in merged[key]) for key in EXTREMES if key in merged})

    def across_ranks(self, metrics: dict[str, float], decisions: int, counts: Sequence[str] = ()) -> dict[str, float]:
        """The ranks' metrics of one update as one set: a count (`counts`) summed, a key ending in max or min the extreme
        over the ranks, any other the mean weighted by each rank's decisions (a spread, such as a std, is then the
        ranks' mean spread)."""
        everyone: list[Any] = [None] * self.size
        dist.all_gather_object(everyone, (metrics, decisions))
        total = sum(count for _, count in everyone) or 1
        merged = {}
        for key in metrics:
            values = [(part[key], count) for part, count in everyone]
            if key in counts:
                merged[key] = sum(v for v, _ in values)
            elif key.endswith(("_max", "/max")):
                merged[key] = max(v for v, _ in values)
            elif key.endswith(("_min", "/min")):
                merged[key] = min(v for v, _ in values)
            else:
                merged[key] = sum(v * count for v, count in values) / total
        return merged

    def gather_to_first(self, item: Any) -> list[Any] | None:
        """Every rank's `item`, in rank order, on rank 0 (None elsewhere)."""
        everyone: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dist.gather_object(item, everyone, dst=0)
        return everyone

    def broadcast_from_first(self, tensors: Sequence[Tensor]) -> None:
        """Rank 0's values into every rank's `tensors`, in place."""
        with torch.no_grad():
            for tensor in tensors:
                dist.broadcast(tensor.data, src=0)
