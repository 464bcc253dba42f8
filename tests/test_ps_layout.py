"""Partitioners and the placement of variables on parameter servers."""

import numpy as np
import pytest

from distrain._src.ps.variable_layout import Layout
from distrain.experimental.partitioners import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
)


def test_fixed_shards_partitioner_splits_axis_0_only():
    p = FixedShardsPartitioner(3)
    assert p((10, 4), np.float32) == [3, 1]
    assert p((2, 4), np.float32) == [2, 1]  # never more pieces than rows
    assert p((), np.float32) == []  # scalars stay whole


def test_min_size_partitioner_follows_tensorflow_rule():
    p = MinSizePartitioner(min_shard_bytes=40, max_shards=4)
    assert p((10, 3), np.float32) == [3, 1]  # 120 bytes // 40
    assert p((2, 3), np.float32) == [1, 1]  # 24 bytes < 40: one piece
    assert MinSizePartitioner()((1000, 1000), np.float32) == [1, 1]  # max_shards=1 default


def test_max_size_partitioner_keeps_pieces_under_the_size():
    assert MaxSizePartitioner(max_shard_bytes=50)((10, 3), np.float32) == [3, 1]
    assert MaxSizePartitioner(max_shard_bytes=50, max_shards=2)((10, 3), np.float32) == [2, 1]


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: FixedShardsPartitioner(0), "num_shards"),
        (lambda: MinSizePartitioner(min_shard_bytes=0), "min_shard_bytes"),
        (lambda: MinSizePartitioner(max_shards=0), "max_shards"),
        (lambda: MaxSizePartitioner(max_shard_bytes=0), "max_shard_bytes"),
        (lambda: MaxSizePartitioner(8, max_shards=0), "max_shards"),
    ],
)
def test_partitioner_arguments_are_checked(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def _params():
    return {
        "b": np.arange(3, dtype=np.float32),
        "w": np.arange(20, dtype=np.float32).reshape(5, 4),
        "s": np.float32(2.0),
    }


def test_layout_places_pieces_round_robin_and_splits_like_array_split():
    layout = Layout.plan(_params(), num_ps=2, partitioner=FixedShardsPartitioner(2))
    assert layout.describe() == [
        ("['b']", 0, (0, 2)),  # np.array_split: first pieces one row larger
        ("['b']", 1, (2, 3)),
        ("['s']", 0, None),  # scalars are never cut
        ("['w']", 1, (0, 3)),
        ("['w']", 0, (3, 5)),
    ]


def test_layout_split_then_join_restores_every_leaf():
    params = _params()
    layout = Layout.plan(params, num_ps=3, partitioner=FixedShardsPartitioner(2))
    leaves = [np.asarray(x) for x in (params["b"], params["s"], params["w"])]
    parts = layout.split(leaves)
    assert len(parts) == 3
    joined = layout.join(parts)
    for a, b in zip(joined, leaves, strict=True):
        np.testing.assert_array_equal(a, b)
    assert [s.shape for s in layout.leaf_specs] == [(3,), (), (5, 4)]


def test_layout_without_partitioner_keeps_leaves_whole():
    layout = Layout.plan(_params(), num_ps=2)
    assert [rows for _, _, rows in layout.describe()] == [None, None, None]


@pytest.mark.parametrize(
    "result, match",
    [
        ([0, 1], "produced no shards"),
        ([], "produced no shards"),
        (None, "produced no shards"),
        ([1, 2], "other than 0"),
        ([9, 1], "only 5 rows"),
    ],
)
def test_bad_partitioner_results_are_clear_errors(result, match):
    with pytest.raises(ValueError, match=match):
        Layout.plan({"w": np.zeros((5, 4), np.float32)}, 2, lambda shape, dtype: result)


def test_empty_or_non_numeric_params_are_rejected():
    with pytest.raises(ValueError, match="at least one array"):
        Layout.plan({}, 1)
    with pytest.raises(ValueError, match="numeric array leaves"):
        Layout.plan({"name": np.array(["a"])}, 1)
