"""Where this process sits in the tensor x pipeline grid, and the groups it talks through.

Rank r holds pipeline stage r // tp_size and tensor-parallel slice r % tp_size; rank 0 is the
driver (scheduler, tokenizer, first stage). Models and layers read their slice through
`tp_group()`, which is a single-rank no-op group unless a worker set a real one.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Rank:
    """One process's coordinates: rank = pp_rank * tp_size + tp_rank."""

    rank: int = 0
    tp_size: int = 1
    pp_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def peer(self, pp_rank: int) -> int:
        """The rank holding the same tensor slice in stage pp_rank."""
        return pp_rank * self.tp_size + self.tp_rank


class TPGroup:
    """The ranks of one pipeline stage that split its heads and features among them.

    `group` carries the device collectives (NCCL on GPUs); `control` is a gloo group of the
    same ranks for host-side agreement: decisions that change which collectives a rank issues
    (a graph warm-up, a dropped capture size) are taken by every rank of the stage together.
    """

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        group: dist.ProcessGroup | None = None,
        control: dist.ProcessGroup | None = None,
    ):
        self.rank, self.size, self.group, self.control = rank, size, group, control

    def agree_max(self, value: int) -> int:
        """The largest of every rank's value (one small gloo all-reduce; value itself alone)."""
        if self.control is None:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return int(t.item())

    def wait_for_peers(self, timeout: float) -> None:
        """Start-up barrier before the stage's first large collective: a rank that loaded
        faster waits up to `timeout` seconds here (not distributed_timeout in a collective),
        and a rank that never comes is named (gloo's monitored barrier)."""
        if self.control is not None:
            dist.monitored_barrier(
                self.control, timeout=datetime.timedelta(seconds=timeout), wait_all_ranks=True
            )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group, in place (the caller's tensor is the result)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x concatenated along dim, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


def startup_timeout(distributed_timeout: float) -> float:
    """Seconds ranks wait for each other at start-up (loading and compiling alone may take
    much longer on one rank than on another) and for host-side agreement: longer than any
    one collective of a step."""
    return max(600.0, 5 * distributed_timeout)


_tp_group = TPGroup()


def tp_group() -> TPGroup:
    return _tp_group


def set_tp_group(group: TPGroup) -> None:
    global _tp_group
    _tp_group = group
