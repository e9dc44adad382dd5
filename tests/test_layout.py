"""The parallel layout's arithmetic (ostinato/layout.py): the heads or features of a tensor rank
and the layers of a pipeline stage, as pure functions of the sizes."""

import re

import pytest

from ostinato.layout import kv_heads_per_rank, rank_share, stage_layers


@pytest.mark.parametrize("units, size", [(8, 1), (8, 2), (8, 8), (12, 4), (6, 3)])
def test_ranks_split_units_evenly_and_cover_each_once(units, size):
    shares = [rank_share(units, rank, size) for rank in range(size)]
    assert all(len(share) == units // size for share in shares)
    assert [u for share in shares for u in share] == list(range(units))


@pytest.mark.parametrize("units, size", [(2, 4), (1, 8), (4, 8), (3, 6)])
def test_fewer_units_than_ranks_are_shared_by_neighbouring_ranks(units, size):
    """Each unit is held whole by size // units consecutive ranks (KV heads replicated)."""
    shares = [rank_share(units, rank, size) for rank in range(size)]
    per = size // units
    assert shares == [range(rank // per, rank // per + 1) for rank in range(size)]
    assert [kv_heads_per_rank(units, size)] * size == [len(s) for s in shares]


def test_kv_heads_per_rank_is_the_share_or_one_replicated_head():
    assert kv_heads_per_rank(8, 2) == 4 and isinstance(kv_heads_per_rank(8, 2), int)  # a count
    assert kv_heads_per_rank(8, 8) == 1
    assert kv_heads_per_rank(2, 8) == 1


@pytest.mark.parametrize("units, size", [(6, 4), (3, 2), (4, 6)])
def test_a_split_that_neither_divides_is_refused(units, size):
    message = (
        f"{units} heads or features cannot be split over {size} tensor ranks: the rank count "
        "must divide them, or be a multiple of them"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        rank_share(units, 0, size)


@pytest.mark.parametrize(
    "layers, stages, expected",
    [
        (4, 1, [range(0, 4)]),
        (4, 2, [range(0, 2), range(2, 4)]),
        (7, 3, [range(0, 3), range(3, 5), range(5, 7)]),  # the earlier stages take the extra
        (3, 3, [range(0, 1), range(1, 2), range(2, 3)]),
    ],
)
def test_an_even_split_gives_earlier_stages_the_extra_layer(layers, stages, expected):
    assert stage_layers(layers, stages) == expected


def test_a_partition_gives_each_stage_its_count_in_order():
    assert stage_layers(6, 3, [1, 4, 1]) == [range(0, 1), range(1, 5), range(5, 6)]
    assert stage_layers(2, 1, [2]) == [range(0, 2)]


@pytest.mark.parametrize(
    "layers, stages, partition, message",
    [
        (4, 2, [4], "pp_layer_partition has 1 entries for pipeline_parallel_size=2: give one "
                    "layer count per stage"),
        (4, 2, [1, 2], "pp_layer_partition 1,2 must give every stage at least one layer and sum "
                       "to the model's 4 layers"),
        (4, 2, [4, 0], "pp_layer_partition 4,0 must give every stage at least one layer"),
        (4, 3, [3, 2, -1], "pp_layer_partition 3,2,-1 must give every stage at least one layer"),
        (2, 3, None, "pp_layer_partition 1,1,0 must give every stage at least one layer and "
                     "sum to the model's 2 layers"),  # an even split of too few layers
    ],
)  # fmt: skip
def test_a_partition_that_misses_a_stage_or_a_layer_is_refused(layers, stages, partition, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        stage_layers(layers, stages, partition)
