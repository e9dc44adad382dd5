"""Where this process sits in the tensor x pipeline grid, and the groups it talks through.

Rank r holds pipeline stage r // tp_size and tensor-parallel slice r % tp_size; rank 0 is the
driver (scheduler, tokenizer, first stage). Models and layers read their slice through
`tp_group()`, which is a single-rank no-op group unless a worker set a real one.
"""

from __future__ import annotations

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
    """The ranks of one pipeline stage that split its heads and features among them."""

    def __init__(self, rank: int = 0, size: int = 1, group: dist.ProcessGroup | None = None):
        self.rank, self.size, self.group = rank, size, group

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


def rank_share(units: int, rank: int, size: int) -> range:
    """The units (attention heads, KV heads, features) tensor rank `rank` of `size` holds: an
    even split, or, with fewer units than ranks, the one unit that size // units ranks share
    (KV heads: ranks 2r and 2r + 1 of 2 * units both hold head r)."""
    if units % size and size % units:
        raise ValueError(
            f"{units} heads or features cannot be split over {size} tensor ranks: the rank "
            "count must divide them, or be a multiple of them"
        )
    start = rank * units // size
    return range(start, start + max(1, units // size))


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """Each tensor rank holds its share of the KV heads, or one replicated head when there are
    fewer heads than ranks."""
    return max(1, num_kv_heads // tp_size)


_tp_group = TPGroup()


def tp_group() -> TPGroup:
    return _tp_group


def set_tp_group(group: TPGroup) -> None:
    global _tp_group
    _tp_group = group


def stage_layers(num_layers: int, pp_size: int, partition: list[int] | None = None) -> list[range]:
    """The layers of each stage: `partition` (counts per stage) or an even split, the earlier
    stages taking one more when it does not divide (the last stage also holds the LM head)."""
    if partition is None:
        base, extra = divmod(num_layers, pp_size)
        partition = [base + (i < extra) for i in range(pp_size)]
    if len(partition) != pp_size:
        raise ValueError(
            f"pp_layer_partition has {len(partition)} entries for pipeline_parallel_size="
            f"{pp_size}: give one layer count per stage"
        )
    if sum(partition) != num_layers or min(partition) < 1:
        raise ValueError(
            f"pp_layer_partition {','.join(map(str, partition))} must give every stage at least "
            f"one layer and sum to the model's {num_layers} layers"
        )
    bounds = [sum(partition[:i]) for i in range(pp_size + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(pp_size)]
