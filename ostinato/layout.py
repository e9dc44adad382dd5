"""Parallel layout arithmetic: which layers a pipeline stage holds and which heads or features a
tensor rank holds. Pure functions of the sizes, used by the config, `explain`, the runner and the
layers alike, so none of them needs to import `distributed/`."""

from __future__ import annotations


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
