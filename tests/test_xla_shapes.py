"""What the XLA trainer decides without torch_xla: its shape buckets (each distinct shape is a
compiled program) and the layouts it refuses (config validation calls the check in any venv)."""

import pytest

from titanrl.config.schema import ParallelConfig
from titanrl.errors import ConfigError
from titanrl.trainer.shape_buckets import length_bucket, row_bucket
from titanrl.config.xla_env import check_xla_layout


def test_length_buckets_are_powers_of_two_from_16():
    assert [length_bucket(t) for t in (1, 16, 17, 32, 33, 100)] == [16, 16, 32, 32, 64, 128]
    assert length_bucket(17, multiple=24) == 48  # then rounded up to the sequence multiple


def test_row_buckets_are_whole_micro_batches_in_powers_of_two():
    """(padded rows, rows per micro-batch): small batches at their own power of two, larger ones
    at 1, 2, 4 ... micro-batches."""
    assert [row_bucket(r, 4) for r in (1, 3, 4, 5, 9, 16)] == [(1, 1), (4, 4), (4, 4), (8, 4), (16, 4), (16, 4)]
    assert row_bucket(5, 6) == (6, 6)  # capped at a micro-batch that is not a power of two


def test_xla_layout_refusals_name_the_field():
    check_xla_layout(ParallelConfig(dp_shard=2, tp=2), devices=4)
    check_xla_layout(ParallelConfig(), devices=4)  # unsharded: replicated over every device
    with pytest.raises(ConfigError, match="torch_xla sees 4 devices"):
        check_xla_layout(ParallelConfig(dp_shard=2), devices=4)
    for field in ("pp", "cp", "ep"):
        with pytest.raises(ConfigError, match=f"train.parallel.{field}=2"):
            check_xla_layout(ParallelConfig(**{field: 2}))
