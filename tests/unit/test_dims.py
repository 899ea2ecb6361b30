"""ParallelDims: validation messages, dp_shard=-1, coordinates and the batch view (no process group)."""
from __future__ import annotations

import pytest

from shardwise.config import ParallelConfig
from shardwise.errors import ConfigError
from shardwise.parallel.mesh import build_meshes
from shardwise.spec.dims import ParallelDims


def dims(world: int, **kw) -> ParallelDims:
    return ParallelDims.from_config(ParallelConfig(**kw), world)


def test_rest_of_world():
    d = dims(8, dp_replicate=2, dp_shard=-1)
    assert d.dp_shard == 4 and d.dp == 8 and d.non_dp == 1


def test_product_message_names_every_factor():
    with pytest.raises(ConfigError) as e:
        dims(8, dp_replicate=2, dp_shard=3, tp=2)
    assert "dp_replicate(2) * dp_shard(3) * cp(1) * tp(2) * pp(1) = 12 != world_size 8" in str(e.value)


def test_ep_folds_into_dp_shard_times_cp():
    assert dims(8, dp_shard=4, cp=2, ep=8).ep == 8
    with pytest.raises(ConfigError, match="ep"):
        dims(4, dp_shard=4, ep=3)


def test_coordinates_are_row_major_with_tp_innermost():
    d = dims(8, dp_replicate=2, dp_shard=2, tp=2)
    assert d.coordinates(0) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0}
    assert d.coordinates(1)["tp"] == 1 and d.coordinates(2)["dp_shard"] == 1 and d.coordinates(4)["dp_replicate"] == 1
    # TP peers read the same data; the batch view covers dp_replicate x dp_shard
    assert [d.batch_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_enabled_axes_and_describe():
    d = dims(4, dp_replicate=2, dp_shard=2)
    assert d.enabled_axes() == ["dp_replicate", "dp_shard"]
    assert d.describe() == "dp_replicate=2,dp_shard=2"
    assert dims(1).enabled_axes() == [] and build_meshes(dims(1), "cpu") is None
